"""Model families; each folder holds only its own architecture and wiring."""
