"""The GPU check (``make gpu-check``, ``python -m pipesgd_lab.gpu_check``; docs/gpu.md): the runner
(runner.py) starts each check of checks.py in a subprocess with its own budget; environment.py says
what they ran on; models.py builds the scale map's compute presets without torchvision."""
