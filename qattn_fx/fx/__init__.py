"""The FX pass: find SDPA sites (match) and rewrite them (rewrite)."""
