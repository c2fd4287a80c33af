"""Tests of gpipe.faults, one module per module (a package: one name everywhere)."""
