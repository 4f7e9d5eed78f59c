"""The load generator behind `ifb bench`."""
