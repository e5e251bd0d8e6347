"""What each cache option computes (sink/OTT pool, dense-and-sparse outliers, pre-RoPE keys, rotations,
flush schedules), beside config.py and layout.py on the bottom floor: the kernels read them."""
