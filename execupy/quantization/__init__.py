"""pt2e int8 quantization for ExecuTorch programs (needs torch and torchao).

    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from execupy.quantization import XNNPACKQuantizer, get_symmetric_quantization_config

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True))
    m = prepare_pt2e(export(model, example).module(), quantizer)
    m(*calibration)
    m = convert_pt2e(m)
    prog = to_edge(export(m, example)).to_executorch()
"""
from .config import PerTokenDynamicObserver, get_symmetric_quantization_config  # noqa: F401
from .xnnpack_quantizer import XNNPACKQuantizer  # noqa: F401
