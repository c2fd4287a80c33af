"""Tests of gpipe.base, one module per module (a package: one name everywhere)."""
