"""The compute of one step: linear and quantised-linear kernels, paged attention, GGUF and
mixture-of-experts decode, and the machine's memory bandwidth."""
