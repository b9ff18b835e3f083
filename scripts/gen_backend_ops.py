#!/usr/bin/env python3
"""Generates src/backend/ops.rs: `Collective<I>`'s implementation of every required method of
Burn's op traits. An op of the `LAZY` table records a node (`lazy.rs`) with its shape and dtype
rule and returns at once; the inner backend runs it when the value is needed. Every other op
runs eagerly: it forces its inputs, calls the inner backend `I`, and wraps the results with the
rank of the first tensor or device argument.

Usage: scripts/gen_backend_ops.py BURN_BACKEND_SRC > src/backend/ops.rs && cargo fmt
where BURN_BACKEND_SRC is the `src` folder of the burn-backend crate the project depends on
(after `cargo fetch`, under cargo's registry folder).
"""
import re
import sys

TRAITS = [
    ("backend/ops/tensor.rs", "FloatTensorOps"),
    ("backend/ops/int_tensor.rs", "IntTensorOps"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps"),
    ("backend/ops/qtensor.rs", "QTensorOps"),
    ("backend/ops/modules/base.rs", "ModuleOps"),
]
TENSORS = ("FloatTensor", "IntTensor", "BoolTensor", "QuantizedTensor")
SPECIAL_RET = {
    "MaxPool2dWithIndices<B>": "wrap_max_pool2d_with_indices",
    "MaxPool2dBackward<B>": "wrap_max_pool2d_backward",
    "DeformConv2dBackward<B>": "wrap_deform_conv2d_backward",
}


def same(t):
    return (f"{t}.shape_hint()", f"{t}.dtype_hint()")


def bcast(a, b, dtype=True):
    return (f"rules::broadcast({a}.shape_hint(), {b}.shape_hint())", f"{a}.dtype_hint()" if dtype else "None")


UNARY = """recip exp log log1p sqrt abs cos sin tan cosh sinh tanh acos acosh asin asinh atan atanh
round floor ceil trunc erf""".split()
SCALAR = "add_scalar sub_scalar mul_scalar div_scalar remainder_scalar".split()
BINARY = "add sub mul div remainder powf atan2".split()
COMPARE = "equal greater greater_equal lower lower_equal".split()

# op -> (shape expression, dtype expression) over the op's argument names.
LAZY = {}
for op in UNARY:
    LAZY[f"float_{op}"] = same("tensor")
for op in SCALAR:
    LAZY[f"float_{op}"] = same("lhs")
for op in BINARY:
    LAZY[f"float_{op}"] = bcast("lhs", "rhs")
for op in COMPARE:
    LAZY[f"float_{op}"] = (bcast("lhs", "rhs")[0], "Some(DType::from(out_dtype))")
    LAZY[f"float_{op}_elem"] = ("lhs.shape_hint()", "Some(DType::from(out_dtype))")
LAZY.update({
    "float_powf_scalar_impl": same("tensor"),
    "float_cumsum": same("tensor"),
    "float_cumprod": same("tensor"),
    "float_mask_fill": same("tensor"),
    "float_mask_where": ("rules::broadcast3(tensor.shape_hint(), mask.shape_hint(), value.shape_hint())", "tensor.dtype_hint()"),
    "float_matmul": ("rules::matmul(lhs.shape_hint(), rhs.shape_hint())", "lhs.dtype_hint()"),
    "float_swap_dims": ("rules::swap(tensor.shape_hint(), dim1, dim2)", "tensor.dtype_hint()"),
    "float_permute": ("rules::permute(tensor.shape_hint(), axes)", "tensor.dtype_hint()"),
    "float_reshape": ("Some(shape.clone())", "tensor.dtype_hint()"),
    "float_expand": ("Some(shape.clone())", "tensor.dtype_hint()"),
    "float_sum": ("rules::scalar()", "tensor.dtype_hint()"),
    "float_sum_dim": ("rules::reduce_dim(tensor.shape_hint(), dim)", "tensor.dtype_hint()"),
    "float_mean_dim": ("rules::reduce_dim(tensor.shape_hint(), dim)", "tensor.dtype_hint()"),
    "float_cast": ("tensor.shape_hint()", "Some(DType::from(dtype))"),
    "float_argmax": ("rules::reduce_dim(tensor.shape_hint(), dim)", "Some(DType::from(out_dtype))"),
    "float_argmin": ("rules::reduce_dim(tensor.shape_hint(), dim)", "Some(DType::from(out_dtype))"),
    # Cross-entropy's gather and its backward; embeddings' select and its backward.
    "float_gather": ("indices.shape_hint()", "tensor.dtype_hint()"),
    "float_scatter_add": same("tensor"),
    "float_select": ("rules::select(tensor.shape_hint(), dim, indices.shape_hint())", "tensor.dtype_hint()"),
    "float_select_add": same("tensor"),
    "conv2d": ("rules::conv(x.shape_hint(), weight.shape_hint(), &options)", "x.dtype_hint()"),
    "conv_transpose2d": ("rules::conv_transpose(x.shape_hint(), weight.shape_hint(), &options)", "x.dtype_hint()"),
})
# op -> (kind, flops expression); the default is elementwise, one flop per result element.
KIND = {
    "float_matmul": ("matmul", "rules::matmul_flops(&node_shape, &lhs.shape_hint())"),
    "conv2d": ("conv", "rules::conv_flops(&node_shape, &weight.shape_hint())"),
    "conv_transpose2d": ("conv", "rules::conv_flops(&x.shape_hint(), &weight.shape_hint())"),
}
for op in ["float_sum", "float_sum_dim", "float_mean_dim", "float_argmax", "float_argmin", "float_cumsum", "float_cumprod"]:
    KIND[op] = ("reduction", "rules::numel(&tensor.shape_hint())")
for op in ["float_swap_dims", "float_permute", "float_reshape", "float_expand"]:
    KIND[op] = ("opaque", "0")

# Borrowed arguments a recorded closure keeps as an owned copy.
OWNED = {"&[usize]": "to_vec()"}


def split_args(args):
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return [a.strip() for a in out if a.strip()]


def trait_methods(src, trait):
    s = re.sub(r"//[^\n]*", "", src)
    start = s.index(f"pub trait {trait}")
    body = s[start:]
    for m in re.finditer(
        r"\n    (?:unsafe )?fn (\w+)(<[^>]*>)?\(((?:[^()]|\([^()]*\))*)\)\s*(?:->\s*([^;{]+?))?\s*([;{])",
        body,
    ):
        name, gen, args, ret, term = m.groups()
        if term == ";":
            yield name, gen or "", split_args(args), (ret or "").strip()


def convert_arg(name, ty, op):
    """(expression passed to the inner backend, rank source or None). `op` names what forces
    a lazy input: the eager op, or nothing inside a recorded closure (its inputs already ran)."""
    t = ty.replace(" ", "")
    into = f'into_inner_for("{op}")' if op else "into_inner()"
    ref = f'inner_for("{op}")' if op else "inner()"
    for k in TENSORS:
        if t == f"{k}<B>":
            return f"{name}.{into}", f"{name}.rank"
        if t == f"&{k}<B>":
            return f"&{name}.{ref}", f"{name}.rank"
        if t == f"Option<{k}<B>>":
            return f"{name}.map(|t| t.{into})", None
    if t == "&Device<B>":
        return f"&{name}.inner", f"{name}.rank"
    if t == "QuantizationParametersPrimitive<B>":
        return f"QuantizationParametersPrimitive {{ scales: {name}.scales.{into} }}", f"{name}.scales.rank"
    if "<B>" in t:
        raise SystemExit(f"unhandled argument type {ty}")
    return name, None


DEVICE_OF = {"FloatTensor": "float_device", "IntTensor": "int_device", "BoolTensor": "bool_device"}


def convert_ret(ret, expr, op=None, inputs=None):
    t = ret.replace(" ", "")
    if t == "":
        return expr
    for k in TENSORS:
        if t == f"{k}<B>":
            if k in DEVICE_OF and inputs:
                # An eager op on recorded tensors: logged, so the step graph stays connected.
                return (f"{{ let p = {expr}; let device: AnyDevice = Arc::new(I::{DEVICE_OF[k]}(&p)); "
                        f"CTensor::eager(rank, Record {{ op: \"{op}\", kind: \"opaque\", device, shape: None, dtype: None, "
                        f"inputs: rules::inputs([{', '.join(f'{i}_seq' for i in inputs)}]), flops: 0 }}, p) }}")
            return f"CTensor::new({expr}, rank)"
    if t == "Device<B>":
        return f"CollectiveDevice::new({expr}, rank)"
    if t == "(FloatTensor<B>,FloatTensor<B>)":
        return f"{{ let (a, b) = {expr}; (CTensor::new(a, rank), CTensor::new(b, rank)) }}"
    if t in SPECIAL_RET:
        return f"{SPECIAL_RET[t]}({expr}, rank)"
    if "<B>" in t:
        raise SystemExit(f"unhandled return type {ret}")
    return expr


def main():
    root = sys.argv[1]
    out = [
        "//! Generated by `scripts/gen_backend_ops.py` from burn-backend 0.21.0's op traits: every",
        "//! required method of `Collective<I>` unwraps its rank-carrying tensors and devices, calls",
        "//! the inner backend and wraps the results with the rank of its first tensor or device.",
        "//! Do not edit by hand; regenerate.",
        "#![allow(clippy::all, unused_variables, missing_docs)]",
        "",
        "use burn_backend::ops::*;",
        "use burn_backend::tensor::*;",
        "use burn_backend::*;",
        "use burn_backend::quantization::*;",
        "use burn_backend::distribution::Distribution;",
        "use burn_std::Slice;",
        "use burn_backend::tensor::Device;",
        "",
        "use super::{Collective, CollectiveDevice, CTensor, wrap_max_pool2d_with_indices, wrap_max_pool2d_backward, wrap_deform_conv2d_backward};",
        "use super::lazy::{rules, AnyDevice, Record};",
        "use std::sync::Arc;",
        "",
    ]
    for path, trait in TRAITS:
        src = open(f"{root}/{path}").read()
        out.append(f"impl<I: Backend> {trait}<Self> for Collective<I> {{")
        for name, gen, args, ret in trait_methods(src, trait):
            params, call, rank = [], [], None
            tensor_args = []
            for a in args:
                n0, ty0 = [x.strip() for x in a.split(":", 1)]
                t0 = ty0.replace(" ", "")
                if any(t0 in (f"{k}<B>", f"&{k}<B>") for k in TENSORS):
                    tensor_args.append((n0.replace("mut ", ""), f"{n0.replace('mut ', '')}.seq()"))
                elif any(t0 == f"Option<{k}<B>>" for k in TENSORS):
                    tensor_args.append((n0.replace("mut ", ""), f"{n0.replace('mut ', '')}.as_ref().and_then(|t| t.seq())"))
                n, ty = [x.strip() for x in a.split(":", 1)]
                n = n.replace("mut ", "")
                params.append(f"{n}: {ty.replace('<B>', '<Self>')}")
                e, r = convert_arg(n, ty, None if name in LAZY else name)
                call.append(e)
                # A device argument names the rank of the result (`to_device` moves ranks);
                # otherwise the first tensor does.
                if r is not None and (rank is None or ty.replace(" ", "") == "&Device<B>"):
                    rank = r
            sig_ret = f" -> {ret.replace('<B>', '<Self>')}" if ret else ""
            needs_rank = any(k in ret for k in TENSORS + ("Device<B>",) + tuple(SPECIAL_RET))
            body = []
            if needs_rank:
                if rank is None:
                    raise SystemExit(f"{trait}::{name}: no rank source")
                body.append(f"let rank = {rank};")
            inner = f"I::{name}({', '.join(call)})"
            kind_device = {"float_device": "float", "int_device": "int", "bool_device": "bool"}
            eager_logged = name not in LAZY and name not in kind_device and tensor_args and any(f"{k}<B>" == ret.replace(" ", "") for k in DEVICE_OF)
            if eager_logged:
                for n, e in tensor_args:
                    body.append(f"let {n}_seq = {e};")
            if name in kind_device:
                body.append(f"CollectiveDevice::new(tensor.device(|p| I::{name}(p)), rank)")
            elif name in LAZY:
                shape, dtype = LAZY.pop(name)
                first = next(x.split(":")[0].strip() for x in args if x.split(":", 1)[1].strip().replace(" ", "") == "FloatTensor<B>")
                body.append(f"let node_device = {first}.device_handle(|p| I::float_device(p));")
                kind, flops = KIND.pop(name, ("elementwise", "rules::numel(&node_shape)"))
                body.append(f"let node_inputs = rules::inputs([{', '.join(e for _, e in tensor_args)}]);")
                body.append(f"let node_shape = {shape};")
                body.append(f"let node_dtype = {dtype};")
                for a in args:
                    n, ty = [x.strip() for x in a.split(":", 1)]
                    t = ty.replace(" ", "")
                    if t.startswith("&") and t not in ("&Device<B>",):
                        if t not in OWNED:
                            raise SystemExit(f"{trait}::{name}: cannot record argument {a}")
                        body.append(f"let {n} = {n}.{OWNED[t]};")
                        inner = inner.replace(f"({n})", f"(&{n})").replace(f", {n})", f", &{n})").replace(f", {n},", f", &{n},").replace(f"({n},", f"(&{n},")
                body.append(f'let node_flops = {flops};\nCTensor::lazy(rank, Record {{ op: "{name}", kind: "{kind}", device: node_device, shape: node_shape, dtype: node_dtype, inputs: node_inputs, flops: node_flops }}, move || {inner})')
            else:
                body.append(convert_ret(ret, inner, name, [n for n, _ in tensor_args] if eager_logged else None))
            out.append(f"    fn {name}{gen}({', '.join(params)}){sig_ret} {{")
            for b in body:
                out.append(f"        {b}")
            out.append("    }")
        out.append("}")
        out.append("")
    if LAZY:
        raise SystemExit(f"lazy ops not found in the traits: {sorted(LAZY)}")
    print("\n".join(out))


main()
