"""Optimizer concerns of trainable sections: building the torch optimizer and its lr schedule
(build.py), the data-parallel gradient reduction (reduce.py) and the end-of-step sequence with
global gradient clipping (stepper.py). Runs in worker processes; knows nothing of sockets."""
