"""Tests of gpipe.engine, one module per module (a package: one name everywhere)."""
