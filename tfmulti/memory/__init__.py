"""The memory model: bytes of parameters, gradients, optimizer slots and
activations per device (`footprint`), and the estimate of a layout before
anything is placed (`estimate`, its arguments checked in `arguments`)."""
