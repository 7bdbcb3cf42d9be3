"""The benchmarked workloads and the memory techniques applied to them."""
