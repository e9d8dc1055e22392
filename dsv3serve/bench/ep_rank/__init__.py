"""One EP rank's share of the full model on one device, for timing only."""
