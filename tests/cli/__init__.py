"""Tests of gpipe.cli, one module per module (a package: one name everywhere)."""
