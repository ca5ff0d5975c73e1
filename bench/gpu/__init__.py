"""The one prepared GPU check (``gpu_check.sh``) and its stages: the profile of a step, CUDA
graph launches, and the README table of its results."""
