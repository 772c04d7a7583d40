"""What a rank runs. This folder holds the rank itself (rank.py: the step loop and its control
calls; scheduler.py, cuda_graphs.py, sampler.py, request.py); the rest sits in rooms:

- models/: one file per architecture family behind registry.py, the layers they share, the
  config and checkpoint readers, the built-in model.
- kernels/: the Triton kernels; each names the torch form it replaces, which tests compare it with.
- exchange/: the EP communicator protocol (communicator.py) and its transports (NIXL, same-node
  peer windows), the expert map.
- weights/: the weight store a pull reads from and writes to, same-node mapping, checksums.
- memory/: device memory: the VMM arena, the stack reserve, host pages.
"""
