"""Tests of gpipe.train, one module per module (a package: one name everywhere)."""
