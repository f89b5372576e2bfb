import os

# The Triton interpreter (CPU) must be chosen before `triton` is first imported: the kernels read it
# when they are decorated. Without it, forcing the Triton path on a machine with no GPU cannot run.
os.environ.setdefault("TRITON_INTERPRET", "1")
