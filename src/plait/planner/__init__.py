"""Planners above the simulator: exhaustive exploration and the heuristics' cheap pick."""
