"""Tests of gpipe.pipe, one module per module (a package: one name everywhere)."""
