"""Stand-in for onnx on the lent GPU machine (scripts/gpu/wheelhouse.py, STUBBED).

nemo/utils/export_utils.py imports onnx at module level and uses it only inside its ONNX export
functions, which `porting` never calls. The image's real onnx cannot load under the carried
protobuf 5.29 (its protos come from protoc 6.31), and ours is too big to carry, so this package
takes the import. Any use of it fails, naming the reason.
"""

__version__ = "1.22.0+stub"


def __getattr__(name: str):
    raise AttributeError(
        f"onnx.{name}: this onnx is a stand-in carried to the GPU machine by porting's "
        "scripts/gpu/wheelhouse.py; ONNX export is not available there"
    )
