"""Local measurement: timing and memory on the device this process runs on."""
