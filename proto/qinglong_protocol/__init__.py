"""Hand-written helpers shared by every service over the generated contracts."""
