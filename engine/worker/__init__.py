"""The device side: the model runner, its persistent request rows, and the buffers that move
values between the host and the device. Never imports the core."""
