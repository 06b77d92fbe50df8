"""Stand-in for ``torch_npu.dynamo``: the three ``torch_dynamo_backends`` entry points the 2.14.0 wheel
declares (``npu``, ``npugraph_ex``, ``npugraphs``); compiling with them fails, as without an NPU."""


def _no_npu_backend(name):
    def backend(gm, example_inputs, **kwargs):
        raise RuntimeError(f"torch.compile backend {name!r}: the torch_npu stub has no NPU")
    return backend


def _npu_backend_entrypoint(*args, **kwargs):
    return _no_npu_backend("npu")(*args, **kwargs)


def _npugraph_ex_backend_entrypoint(*args, **kwargs):
    return _no_npu_backend("npugraph_ex")(*args, **kwargs)


def _npugraphs_backend_entrypoint(*args, **kwargs):
    return _no_npu_backend("npugraphs")(*args, **kwargs)
