"""Fish Audio S2 Pro: a Dual-AR model (a slow AR over semantic tokens, a fast AR over each frame's residual codebooks)
and its DAC codec."""
