"""What `kivi calibrate` fits offline and writes to a calibration file: nuq levels, rotations, per-layer bits."""
