#!/usr/bin/env python3
"""Generates src/backend/ops.rs: `Collective<I>`'s implementation of *every* method of Burn's op
traits, required or with a default body, so that `Collective<I>` computes exactly what `I`
computes (a default body of Burn's would bypass the inner backend's own implementation).

The generator holds no rules. It emits plumbing only:
- An op that has a function of the same name in `src/backend/op_table.rs` (the record rules,
  Rust) records a node: its rule gets what is known of each tensor argument (`Meta`) and a
  reference to every other argument, and the node calls `I::<op>` when it runs.
- Every other op runs eagerly: it forces its tensor inputs, calls `I::<op>` and wraps the results
  with the rank of its device argument or first tensor (a float/int/bool result computed from
  tensors is logged, so the step graph stays connected through it).

Usage:
  scripts/gen_backend_ops.py BURN_BACKEND_SRC            # writes src/backend/ops.rs (rustfmt'd)
  scripts/gen_backend_ops.py BURN_BACKEND_SRC --check    # exits 1 if src/backend/ops.rs is stale
BURN_BACKEND_SRC is the `src` folder of the burn-backend crate the project depends on; without
it, the script asks `cargo metadata` where that is.
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "src/backend/ops.rs")
TABLE = os.path.join(ROOT, "src/backend/op_table.rs")

TRAITS = [
    ("backend/ops/tensor.rs", "FloatTensorOps"),
    ("backend/ops/int_tensor.rs", "IntTensorOps"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps"),
    ("backend/ops/qtensor.rs", "QTensorOps"),
    ("backend/ops/modules/base.rs", "ModuleOps"),
    ("backend/ops/activation.rs", "ActivationOps"),
    ("backend/ops/transaction.rs", "TransactionOps"),
]
KINDS = {"FloatTensor": "float", "IntTensor": "int", "BoolTensor": "bool", "QuantizedTensor": "q"}
# Results whose tensors the `forward` module wraps (pooling with indices, backward structs).
WRAPPED = {
    "MaxPool1dWithIndices<B>": "max_pool_with_indices_1d",
    "MaxPool1dBackward<B>": "max_pool_backward_1d",
    "MaxPool2dWithIndices<B>": "max_pool_with_indices_2d",
    "MaxPool2dBackward<B>": "max_pool_backward_2d",
    "DeformConv2dBackward<B>": "deform_conv2d_backward",
}
# Borrowed arguments a recorded closure keeps as an owned copy.
OWNED = {"&[usize]": "to_vec()", "&Device<B>": "inner.clone()"}


def burn_backend_src():
    host = next(l.split(": ", 1)[1] for l in subprocess.check_output(
        ["rustc", "-vV"], text=True).splitlines() if l.startswith("host: "))
    meta = json.loads(subprocess.check_output(
        ["cargo", "metadata", "--format-version", "1", "--locked", "--filter-platform", host],
        cwd=ROOT))
    for p in meta["packages"]:
        if p["name"] == "burn-backend":
            return os.path.join(os.path.dirname(p["manifest_path"]), "src")
    raise SystemExit("burn-backend is not a dependency")


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


def trait_body(src, trait):
    """The text between the trait's braces, comments removed."""
    s = re.sub(r"//[^\n]*", "", src)
    start = s.index("{", s.index(f"pub trait {trait}"))
    depth = 0
    for i in range(start, len(s)):
        if s[i] == "{":
            depth += 1
        elif s[i] == "}":
            depth -= 1
            if depth == 0:
                return s[start + 1:i]
    raise SystemExit(f"unbalanced trait {trait}")


def trait_methods(src, trait):
    body = trait_body(src, trait)
    for m in re.finditer(
        r"\n    (?:unsafe )?fn (\w+)(<[^>]*>)?\(((?:[^()]|\([^()]*\))*)\)\s*(?:->\s*([^;{]+?))?\s*([;{])",
        body,
    ):
        name, gen, args, ret, _ = m.groups()
        yield name, gen or "", split_args(args), (ret or "").strip()


def lazy_ops():
    """The ops `op_table.rs` has a rule for: each `pub(crate) fn` at the top level, and each
    name listed in a `conv_rules!(N: name, ...)` line (one rule set per spatial rank)."""
    text = open(TABLE).read()
    names = set(re.findall(r"\npub\(crate\) fn (\w+)", text))
    for listed in re.findall(r"\nconv_rules!\(\d+:([^)]*)\);", text):
        names.update(n.strip() for n in listed.split(",") if n.strip())
    return names


def tensor_kind(t):
    """(kind, form) of a tensor-carrying argument type: form is one of value, ref, option, vec."""
    for k in KINDS:
        if t == f"{k}<B>":
            return k, "value"
        if t == f"&{k}<B>":
            return k, "ref"
        if t == f"Option<{k}<B>>":
            return k, "option"
        if t == f"Vec<{k}<B>>":
            return k, "vec"
    return None, None


def convert_arg(name, t, force):
    """The expression passed to the inner backend. `force` names the eager op that forces a
    lazy input; None inside a recorded closure, whose inputs already ran."""
    into = f'into_inner_for("{force}")' if force else "into_inner()"
    ref = f'inner_for("{force}")' if force else "inner()"
    k, form = tensor_kind(t)
    if form == "value":
        return f"{name}.{into}"
    if form == "ref":
        return f"&{name}.{ref}"
    if form == "option":
        return f"{name}.map(|t| t.{into})"
    if form == "vec":
        return f"{name}.into_iter().map(|t| t.{into}).collect()"
    if t == "&Device<B>":
        return f"&{name}.inner"
    if t == "TensorPrimitive<B>":
        return f'forward::primitive_inner({name}, "{force}")'
    if t == "QuantizationParametersPrimitive<B>":
        return f"QuantizationParametersPrimitive {{ scales: {name}.scales.{into} }}"
    if t == "TransactionPrimitive<B>":
        return f"forward::transaction::<I>({name})"
    if "<B>" in t:
        raise SystemExit(f"unhandled argument type {t}")
    return name


def rank_source(name, t):
    k, form = tensor_kind(t)
    if form in ("value", "ref"):
        return f"{name}.rank"
    if form == "vec":
        return f"forward::rank_of(&{name})"
    if t == "&Device<B>":
        return f"{name}.rank"
    if t == "TensorPrimitive<B>":
        return f"forward::primitive_rank(&{name})"
    if t == "QuantizationParametersPrimitive<B>":
        return f"{name}.scales.rank"
    return None


def wrap(t, expr, logged):
    """Wraps the inner backend's result `expr` of type `t` into `Collective`'s."""
    for k, kind in KINDS.items():
        if t == f"{k}<B>":
            if logged and kind != "q":
                return f"log.{kind}::<I>(rank, {expr})"
            return f"CTensor::new({expr}, rank)"
    if t == "Device<B>":
        return f"CollectiveDevice::new({expr}, rank)"
    if t == "TensorPrimitive<B>":
        return f"forward::primitive({expr}, rank)"
    if t in WRAPPED:
        return f"forward::{WRAPPED[t]}({expr}, rank)"
    m = re.fullmatch(r"\((\w+<B>),(\w+<B>)\)", t)
    if m:
        a = wrap(m.group(1), "a", logged)
        b = wrap(m.group(2), "b", logged)
        if logged:
            a = a.replace("log.", "log.clone().", 1)
        return f"{{ let (a, b) = {expr}; ({a}, {b}) }}"
    m = re.fullmatch(r"implFuture<Output=(\w+<B>)>\+'static\+Send", t)
    if m:
        inner = wrap(m.group(1), "fut.await", False)
        return f"{{ let fut = {expr}; async move {{ {inner} }} }}"
    if "<B>" in t:
        raise SystemExit(f"unhandled return type {t}")
    return expr


def first_device(args):
    """The device handle of a recorded node: its device argument's (a creation or a move puts
    its result there), else its first tensor argument's."""
    for n, t in args:
        if t == "&Device<B>":
            return f"std::sync::Arc::new({n}.inner.clone())"
    for n, t in args:
        k, form = tensor_kind(t)
        if form == "value" and k != "QuantizedTensor":
            return f"{n}.device_handle(|p| I::{KINDS[k]}_device(p))"
    raise SystemExit(f"no tensor argument to take the device from: {args}")


def method(trait, name, gen, raw_args, ret, lazy):
    args = []
    for a in raw_args:
        n, ty = [x.strip() for x in a.split(":", 1)]
        ty = ty.replace("crate::", "burn_backend::")
        args.append((n.replace("mut ", ""), ty.replace(" ", "")))
    ret_t = ret.replace(" ", "")
    params = ", ".join(
        f"{n}: {a.split(':', 1)[1].strip().replace('crate::', 'burn_backend::').replace('<B>', '<Self>')}"
        for (n, _), a in zip(args, raw_args))
    sig_ret = f" -> {ret.replace('<B>', '<Self>')}" if ret else ""
    # A device argument names the rank of the result (`to_device` moves ranks); otherwise the
    # first tensor does.
    rank = None
    for n, t in args:
        r = rank_source(n, t)
        if r is not None and (rank is None or t == "&Device<B>"):
            rank = r
    needs_rank = "<B>" in ret_t and not ret_t.startswith("implFuture<Output=Result<")
    body = []
    if needs_rank:
        if rank is None:
            raise SystemExit(f"{trait}::{name}: no rank source")
        body.append(f"let rank = {rank};")
    tensors = [(n, t) for n, t in args if tensor_kind(t)[0]]
    if name in ("float_device", "int_device", "bool_device", "q_device"):
        body.append(f"CollectiveDevice::new(tensor.device(|p| I::{name}(p)), rank)")
    elif lazy:
        rule_args = []
        for n, t in args:
            k, form = tensor_kind(t)
            if form == "value":
                rule_args.append(f"{n}.meta()")
            elif form == "option":
                rule_args.append(f"{n}.as_ref().map(CTensor::meta)")
            elif form is not None:
                raise SystemExit(f"{trait}::{name}: a recorded op takes {t}")
            elif t.startswith("&"):
                rule_args.append(n)
            else:
                rule_args.append(f"&{n}")
        body.append(f"let rule = op_table::{name}({', '.join(rule_args)});")
        seqs = ", ".join(
            f"{n}.seq()" if tensor_kind(t)[1] == "value" else f"{n}.as_ref().and_then(CTensor::seq)"
            for n, t in tensors)
        body.append(f"let node = rule.record(\"{name}\", {first_device(args)}, rules::inputs([{seqs}]));")
        call = []
        for n, t in args:
            if t.startswith("&") and tensor_kind(t)[0] is None:
                if t not in OWNED:
                    raise SystemExit(f"{trait}::{name}: cannot record argument {n}: {t}")
                body.append(f"let {n} = {n}.{OWNED[t]};")
                call.append(f"&{n}")
            else:
                call.append(convert_arg(n, t, None))
        body.append(f"CTensor::lazy(rank, node, move || I::{name}({', '.join(call)}))")
    else:
        logged = bool(tensors) and re.search(r"(Float|Int|Bool)Tensor<B>", ret_t) is not None
        if logged:
            seqs = []
            for n, t in tensors:
                form = tensor_kind(t)[1]
                seqs.append({
                    "value": f"{n}.seq()", "ref": f"{n}.seq()",
                    "option": f"{n}.as_ref().and_then(CTensor::seq)",
                }.get(form, f"{n}.iter().filter_map(CTensor::seq)"))
            singles = [s for s in seqs if not s.endswith("filter_map(CTensor::seq)")]
            vecs = [s for s in seqs if s.endswith("filter_map(CTensor::seq)")]
            it = f"rules::inputs([{', '.join(singles)}])"
            for v in vecs:
                it = f"{it}.into_iter().chain({v}).collect()" if singles else f"{v}.collect()"
            body.append(f"let log = Eager::new(\"{name}\", {it});")
        call = [convert_arg(n, t, name) for n, t in args]
        body.append(wrap(ret_t, f"I::{name}({', '.join(call)})", logged))
    lines = [f"    fn {name}{gen}({params}){sig_ret} {{"]
    lines += [f"        {b}" for b in body]
    lines.append("    }")
    return lines


def generate(src_root):
    lazy = lazy_ops()
    out = [
        "//! Generated by `scripts/gen_backend_ops.py` from burn-backend 0.21.0's op traits: every",
        "//! method of `Collective<I>`, required or defaulted, calls the inner backend's own. An op",
        "//! with a rule in `op_table.rs` records a node; every other op runs eagerly on its forced",
        "//! inputs. Do not edit by hand: change `op_table.rs` and regenerate (CI checks it is current).",
        "#![allow(clippy::all, unused_variables, missing_docs)]",
        "",
        "use burn_backend::distribution::Distribution;",
        "use burn_backend::ops::*;",
        "use burn_backend::quantization::*;",
        "use burn_backend::tensor::Device;",
        "use burn_backend::tensor::*;",
        "use burn_backend::*;",
        "use burn_std::Slice;",
        "use core::ops::Range;",
        "",
        "use super::forward::{self, Eager};",
        "use super::{CTensor, Collective, CollectiveDevice, op_table, rules};",
        "",
    ]
    seen = set()
    for path, trait in TRAITS:
        src = open(f"{src_root}/{path}").read()
        out.append(f"impl<I: Backend> {trait}<Self> for Collective<I> {{")
        for name, gen, args, ret in trait_methods(src, trait):
            out += method(trait, name, gen, args, ret, name in lazy)
            seen.add(name)
        out.append("}")
        out.append("")
    missing = sorted(lazy - seen)
    if missing:
        raise SystemExit(f"op_table.rs has rules for ops no trait has: {missing}")
    text = "\n".join(out) + "\n"
    fmt = subprocess.run(["rustfmt", "--edition", "2024", "--emit", "stdout"], input=text,
                         capture_output=True, text=True, cwd=ROOT)
    if fmt.returncode != 0:
        sys.stderr.write(fmt.stderr)
        raise SystemExit("rustfmt failed on the generated file")
    return fmt.stdout


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    src_root = args[0] if args else burn_backend_src()
    text = generate(src_root)
    if "--check" in sys.argv:
        if open(OUT).read() != text:
            sys.stderr.write("src/backend/ops.rs is stale: run scripts/gen_backend_ops.py\n")
            sys.exit(1)
        print("src/backend/ops.rs is current")
    else:
        open(OUT, "w").write(text)


main()
