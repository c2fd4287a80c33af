"""Tests of gpipe.parallel, one module per module (a package: one name everywhere)."""
