"""OpInfo conformance: torch's op_db run on DTensors (vescale's and torch's own) on a
4-rank 1-d mesh and a 2x2 mesh, compared with single-device results.

``python -m tests.opinfo.run --out docs/op_coverage.md`` runs everything;
``tests/opinfo/test_opinfo_subset.py`` is the fast subset for CI."""
