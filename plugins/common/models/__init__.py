"""The shared decoder: its configuration, the torch layer stack and its native whole-stack twin."""
