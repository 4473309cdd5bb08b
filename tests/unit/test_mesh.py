"""Meshes and topologies (planner/_mesh.py): validation with messages that say how to fix the
call, the CLI's ``dp=2,tp=2`` syntax, row-major strides, which link an axis runs over, and
topology files (round trip, atomic save, loading errors)."""

from __future__ import annotations

import json
import math

import pytest

from meshplan.planner import PRESETS, Link, Mesh, PlanError, Topology, get_topology, parse_mesh

H100, CPU = PRESETS["h100"], PRESETS["cpu"]


# ---- Mesh validation -------------------------------------------------------------------------

@pytest.mark.parametrize(("axes", "match"), [
    ({}, r"at least one axis.*\{'dp': 2\}"),
    ((("dp", 2), ("dp", 4)), r"unique.*\['dp', 'dp'\]"),
    ({"1dp": 2}, r"'1dp' must be an identifier"),
    ({"d-p": 2}, r"'d-p' must be an identifier"),
    ({"": 2}, r"'' must be an identifier"),
    ({"dp": 0}, r"axis 'dp' must have a positive integer size, got 0"),
    ({"dp": -2}, r"axis 'dp'.*got -2"),
    ({"dp": 2.0}, r"axis 'dp'.*got 2\.0"),
    ({"dp": "2"}, r"axis 'dp'.*got '2'"),
])
def test_bad_meshes_say_what_and_how(axes, match) -> None:
    with pytest.raises(PlanError, match=match):
        Mesh(axes)


def test_a_mesh_keeps_axis_order_and_binds_a_topology() -> None:
    m = Mesh({"pp": 2, "dp": 3, "tp": 4}, "h100")
    assert m.names == ("pp", "dp", "tp") and m.sizes == (2, 3, 4) and m.size == 24
    assert m.topology is H100
    assert Mesh((("dp", 2),)) == Mesh({"dp": 2})            # tuple and mapping forms agree
    assert Mesh({"dp": 2}).topology is CPU                   # the default topology
    assert str(m) == "pp=2,dp=3,tp=4 (h100)"


def test_unknown_axis_names_the_axes_there_are() -> None:
    with pytest.raises(PlanError, match=r"no axis 'sp'; its axes are \['dp', 'tp'\]"):
        Mesh({"dp": 2, "tp": 2}).index("sp")
    assert Mesh({"dp": 2, "tp": 2}).index("tp") == 1


def test_meshes_are_immutable_values() -> None:
    m = Mesh({"dp": 2})
    with pytest.raises(AttributeError):
        m.axes = (("dp", 4),)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        m.topology.name = "other"  # type: ignore[misc]


def test_meshes_are_hashable() -> None:
    assert hash(Mesh({"dp": 2}, "h100")) == hash(Mesh({"dp": 2}, "h100"))


# ---- parse_mesh --------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("dp=2,tp=2", {"dp": 2, "tp": 2}),
    ("dp=8", {"dp": 8}),
    (" dp = 2 , tp=4 ", {"dp": 2, "tp": 4}),
    ("dp=2,", {"dp": 2}),
])
def test_parse_mesh(text, expected) -> None:
    out = parse_mesh(text)
    assert out == expected and list(out) == list(expected)   # axis order is kept


@pytest.mark.parametrize(("text", "match"), [
    ("dp", r"expected AXIS=SIZE.*dp=2,tp=2"),
    ("dp=", r"expected AXIS=SIZE"),
    ("dp=x", r"expected AXIS=SIZE"),
    ("dp=-1", r"expected AXIS=SIZE"),
    ("dp=2.5", r"expected AXIS=SIZE"),
    ("dp:2", r"expected AXIS=SIZE"),
    ("", r"names no axis"),
    (" , ", r"names no axis"),
])
def test_parse_mesh_rejects_bad_forms(text, match) -> None:
    with pytest.raises(PlanError, match=match):
        parse_mesh(text)


def test_parsed_meshes_are_validated_by_mesh() -> None:
    for text in ("dp=0", "=2", "1x=2"):
        with pytest.raises(PlanError):
            Mesh(parse_mesh(text))


def test_parse_mesh_rejects_repeated_axes() -> None:
    with pytest.raises(PlanError):
        parse_mesh("dp=2,dp=4")


# ---- strides and links -----------------------------------------------------------------------

def test_row_major_strides() -> None:
    m = Mesh({"a": 2, "b": 3, "c": 4})
    assert [m.stride(i) for i in range(3)] == [12, 4, 1]
    # rank = sum(coord * stride) enumerates 0..size-1 exactly once, last axis innermost
    ranks = sorted(a * 12 + b * 4 + c for a in range(2) for b in range(3) for c in range(4))
    assert ranks == list(range(m.size))
    assert Mesh({"dp": 5}).stride(0) == 1


@pytest.mark.parametrize(("axes", "expected"), [
    ({"dp": 8, "tp": 8}, {"dp": "inter", "tp": "intra"}),   # tp: stride 1 x 8 = 8 <= 8
    ({"tp": 16}, {"tp": "inter"}),
    ({"tp": 8}, {"tp": "intra"}),
    ({"dp": 2, "tp": 4}, {"dp": "intra", "tp": "intra"}),    # dp spans 4 x 2 = 8 ranks
    ({"dp": 4, "tp": 4}, {"dp": "inter", "tp": "intra"}),    # dp spans 16
    ({"tp": 2, "dp": 4}, {"tp": "intra", "dp": "intra"}),    # order decides, not the name
    ({"pp": 2, "dp": 4, "tp": 2}, {"pp": "inter", "dp": "intra", "tp": "intra"}),
    ({"dp": 64, "tp": 1}, {"dp": "inter", "tp": "intra"}),
])
def test_link_is_intra_node_only_for_axes_inside_a_node(axes, expected) -> None:
    m = Mesh(axes, "h100")
    links = {"intra": H100.intra_node, "inter": H100.inter_node}
    for i, name in enumerate(m.names):
        assert m.link(i) == links[expected[name]], name
    assert H100.intra_node.bandwidth > H100.inter_node.bandwidth


def test_an_axis_straddling_a_node_boundary_is_inter_node() -> None:
    m = Mesh({"a": 4, "c": 3}, "h100")            # c groups: {0,1,2} ... {6,7,8} crosses 8
    assert m.link(1) == H100.inter_node


# ---- Link and Topology ------------------------------------------------------------------------

@pytest.mark.parametrize(("bw", "lat"), [(0, 1e-6), (-1, 0), (1e9, -1e-6), (math.nan, 0)])
def test_bad_links(bw, lat) -> None:
    with pytest.raises(PlanError, match="bandwidth > 0 and latency >= 0"):
        Link(bandwidth=bw, latency=lat)


def _topology(**changes) -> Topology:
    base = dict(name="t", flops={"float32": 1e12}, memory_bandwidth=1e11, memory_bytes=1 << 30,
                devices_per_node=4, intra_node=Link(1e10, 1e-6), inter_node=Link(1e9, 1e-5))
    return Topology(**{**base, **changes})


@pytest.mark.parametrize(("changes", "match"), [
    ({"flops": {}}, "flops must map dtypes to positive"),
    ({"flops": {"float32": 0.0}}, "flops must map dtypes to positive"),
    ({"memory_bytes": 0}, "memory and devices_per_node"),
    ({"memory_bandwidth": -1.0}, "memory and devices_per_node"),
    ({"devices_per_node": 0}, "memory and devices_per_node"),
    ({"compute_efficiency": 0.0}, r"compute_efficiency must be in \(0, 1\]"),
    ({"compute_efficiency": 1.5}, r"compute_efficiency must be in \(0, 1\]"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda', got 'tpu'"),
])
def test_bad_topologies_name_themselves(changes, match) -> None:
    with pytest.raises(PlanError, match=f"topology 't': {match}"):
        _topology(**changes)


def test_flops_for_falls_back_to_the_slowest_known_dtype() -> None:
    t = _topology(flops={"float32": 2e12, "bfloat16": 8e12})
    assert t.flops_for("bfloat16") == 8e12 and t.flops_for("float64") == 2e12


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_topology_dict_round_trip(name) -> None:
    t = PRESETS[name]
    d = json.loads(json.dumps(t.to_dict()))                  # through JSON, as files are
    assert Topology.from_dict(d) == t
    assert set(d) >= {"name", "flops", "intra_node", "inter_node", "memory_bytes"}


def test_a_topology_file_from_before_the_device_field_reads_it_from_the_name() -> None:
    """The device picks the fused kernels the cost model prices; files written before it was
    recorded were CPU machines when named cpu... or calibrated..."""
    for name, device in (("cpu+run-1", "cpu"), ("calibrated", "cpu"), ("h100", "cuda")):
        d = PRESETS["h100"].to_dict()
        del d["device"]
        assert Topology.from_dict({**d, "name": name}).device == device
    assert PRESETS["cpu"].device == "cpu" and PRESETS["h100"].device == "cuda"


def test_save_and_load_a_topology_file(tmp_path) -> None:
    t = _topology(name="mine", flops={"float32": 3e10, "bfloat16": 1e9}, kernel_floor_s=2e-6)
    path = tmp_path / "topo.json"
    t.save(str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["topo.json"]     # no temporary left over
    assert get_topology(str(path)) == t
    assert Mesh({"dp": 2}, str(path)).topology == t
    t2 = _topology(name="mine", devices_per_node=8)
    t2.save(str(path))                                        # overwrites in place
    assert get_topology(str(path)) == t2


def test_get_topology_accepts_names_objects_and_none() -> None:
    assert get_topology(None) is CPU and get_topology("h100") is H100
    t = _topology()
    assert get_topology(t) is t


def test_unknown_topology_lists_presets_and_calibrate() -> None:
    with pytest.raises(PlanError, match=r"unknown topology 'v100'.*\['a100', 'b200', 'cpu', "
                       r"'h100', 'h200'\].*h100:fabric=200.*calibrate"):
        get_topology("v100")


# (name, dense bf16 TFLOP/s, TF32, FP8 or None, HBM GB, HBM TB/s, NVLink GB/s both ways), as the
# presets' comments cite them from NVIDIA's datasheets
_DATASHEETS = [("a100", 312, 156, None, 80, 2.039, 600), ("h100", 989, 494, 1979, 80, 3.35, 900),
               ("h200", 989, 494, 1979, 141, 4.8, 900), ("b200", 2250, 1100, 4500, 180, 8.0, 1800)]


@pytest.mark.parametrize(("name", "bf16", "tf32", "fp8", "hbm", "hbm_tbps", "nvlink"), _DATASHEETS)
def test_gpu_presets_hold_their_datasheet_numbers(name, bf16, tf32, fp8, hbm, hbm_tbps,
                                                  nvlink) -> None:
    t = PRESETS[name]
    assert t.flops_for("bfloat16") == t.flops_for("float16") == bf16 * 1e12
    assert t.flops_for("float32") == tf32 * 1e12
    assert t.flops_for("float8_e4m3fn") == (fp8 * 1e12 if fp8 else tf32 * 1e12)   # no FP8: slowest
    assert t.memory_bytes == hbm * 10**9 and t.memory_bandwidth == pytest.approx(hbm_tbps * 1e12)
    assert t.devices_per_node == 8
    assert t.intra_node.bandwidth == pytest.approx(nvlink / 2 * 1e9)     # one direction
    assert t.inter_node.bandwidth == pytest.approx(0.95 * 400 / 8 * 1e9)  # 400 Gb/s NIC per GPU


def test_topology_options_set_the_fabric_and_the_node_size() -> None:
    t = get_topology("a100:fabric=200, gpus_per_node=4")
    assert t.name == "a100:fabric=200, gpus_per_node=4" and t.devices_per_node == 4
    assert t.inter_node.bandwidth == pytest.approx(0.95 * 200 / 8 * 1e9)
    assert t.flops == PRESETS["a100"].flops and t.intra_node == PRESETS["a100"].intra_node
    # an axis of 8 spans two nodes of 4: it runs on the slower fabric
    assert Mesh({"dp": 8}, t).link(0) == t.inter_node
    assert Mesh({"dp": 8}, "a100").link(0) == PRESETS["a100"].intra_node
    for bad in ("h100:fabric=fast", "h100:fabric=-1", "h100:gpus_per_node=2.5", "h100:nics=2"):
        with pytest.raises(PlanError, match=r"cannot read.*fabric=GBITS_PER_S"):
            get_topology(bad)


@pytest.mark.parametrize(("content", "match"), [
    ("{not json", r"is not JSON"),
    ("", r"is not JSON"),
    ("[]", r"bad topology description"),
    ('{"name": "x"}', r"bad topology description \(KeyError"),
    (json.dumps({**CPU.to_dict(), "memory_bytes": "lots"}), r"bad topology description"),
    (json.dumps({**CPU.to_dict(), "intra_node": {"bandwidth": 1e9}}), r"bad topology description"),
    (json.dumps({**CPU.to_dict(), "flops": {"float32": "fast"}}), r"bad topology description"),
    (json.dumps({**CPU.to_dict(), "inter_node": {"bandwidth": -1, "latency": 0}}),
     r"bandwidth > 0"),
])
def test_corrupt_topology_files(tmp_path, content, match) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(PlanError, match=match):
        get_topology(str(path))
