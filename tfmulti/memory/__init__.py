"""The memory model and the estimate: the one package that counts the bytes
a device needs to train.

    footprint  the memory model: bytes of parameters, gradients, optimizer
               slots and activations per device, for a stack of layers, a
               stage, a whole model or a placed pipeline (`pipeline_footprint`)
    shares     what each of T devices holds of a tensor-parallel layer
    estimate   the estimate of a layout before anything is placed
    arguments  the estimate's arguments, checked without TensorFlow
"""
