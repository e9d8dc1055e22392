"""Expert-parallel load balancing: placement, the logical -> physical id map, load counts,
and moving expert weights between ranks (docs/eplb.md)."""
