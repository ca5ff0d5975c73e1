"""The simulated accelerator: the engine benchmark and speculative decoding at GPU speed, the
traces its device replays, and the calibration of its costs against the GPU check."""
