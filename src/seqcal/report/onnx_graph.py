"""The traced graph as an ONNX file for Netron: structure and shapes only, no weights, not runnable.

Each fx node becomes an ONNX node of the custom domain ``seqcal`` whose op type is the module class or
function name (``LlamaDecoderLayer``, ``add``, ``sdpa_attention_forward``), with the module path, fx target
and subgraph index as attributes; recorded output shapes become value infos, so Netron shows them on the
edges. The ``onnx`` package writes the protobuf (``pip install onnx``); it is imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# torch dtype names (graph_dict's "dtypes") -> ONNX TensorProto element types
_ELEM = {"float32": 1, "uint8": 2, "int8": 3, "int16": 5, "int32": 6, "int64": 7, "bool": 9, "float16": 10,
         "float64": 11, "bfloat16": 16}  # fmt: skip


def _op_type(node: Mapping[str, Any]) -> str:
    if node["op"] == "call_module" and node.get("class"):
        return str(node["class"])
    target = str(node["target"])
    if target.startswith("opaque "):  # code run opaquely: "opaque LlamaModel.forward file:line"
        return "Opaque"
    return target.split(" ")[0].rsplit(".", 1)[-1] or node["op"]


def _value_info(onnx: Any, name: str, node: Mapping[str, Any]) -> Any:
    """The first recorded output of ``node`` as a typed value (unknown type and shape when not recorded)."""
    shapes, dtypes = node.get("shapes") or [], node.get("dtypes") or []
    shape = shapes[0] if shapes and isinstance(shapes[0], list) else None
    elem = _ELEM.get(str(dtypes[0]).removeprefix("torch."), 0) if dtypes else 0
    return onnx.helper.make_tensor_value_info(name, elem, shape)


def to_onnx(data: Mapping[str, Any]) -> bytes:
    """Serialize ``graph_dict``'s data as an ONNX ModelProto (bytes).

    Raises:
        ImportError: the onnx package is not installed (says how to install it).

    Example:
        >>> Path("graph.onnx").write_bytes(to_onnx(graph_dict(subgraphs, sample)))  # doctest: +SKIP
    """
    try:
        import onnx
    except ImportError as err:
        raise ImportError("the onnx graph export needs the onnx package: pip install onnx") from err
    helper = onnx.helper
    nodes, inputs, outputs, infos = [], [], [], []
    for node in data["nodes"]:
        if node["op"] == "placeholder":
            inputs.append(_value_info(onnx, node["name"], node))
        elif node["op"] == "output":
            outputs += [helper.make_tensor_value_info(name, 0, None) for name in node["inputs"]]
        else:
            attrs = {"fx_op": node["op"], "target": str(node["target"]), "subgraph": node["subgraph"] or 0}
            if node.get("module"):
                attrs["module"] = node["module"]
            nodes.append(helper.make_node(_op_type(node), node["inputs"], [node["name"]], name=node["name"],
                                          domain="seqcal", **attrs))  # fmt: skip
            if node.get("shapes"):
                infos.append(_value_info(onnx, node["name"], node))
    graph = helper.make_graph(nodes, str(data.get("model", "model")), inputs, outputs, value_info=infos)
    model = helper.make_model(graph, producer_name="seqcal",
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("seqcal", 1)])  # fmt: skip
    return model.SerializeToString()
