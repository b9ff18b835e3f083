//! The text form, its parser, and the verifier.

mod common;

use collective_fusion::graph::parse::parse;
use collective_fusion::graph::print::print;
use collective_fusion::graph::verify::{VerifyOptions, verify};
use common::{G, chain, roundtrip};

fn violations(text: &str, cap: Option<u64>) -> String {
    let g = parse(text).unwrap_or_else(|e| panic!("{e}"));
    match verify(
        &g,
        &VerifyOptions {
            bucket_cap_bytes: cap,
        },
    ) {
        Ok(()) => String::from("ok"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn parse_print_round_trips_every_op() {
    let text = r#"graph "all ops" {
  group g0 size=4
  %0 = parameter "w" : f32[4,4]
  %1 = input "x" : f32[2,4]
  %2 = compute "mm" kind=matmul flops=64 (%1, %0) : f32[2,4]
  %3 = gradient "w" (%2) : f32[4,4]
  %4 = gradient "v" (%2) : f32[4]
  %5 = bucket_pack bucket=0 scale=1/4 (%3, %4) : bf16[20] ; 2 tensors, 80 B
  %6 = all_reduce_start reduce=sum group=g0 bucket=0 (%5) : bf16[20] ; 40 B, overlaps up to 0 compute
  %7 = all_reduce_done bucket=0 (%6) : bf16[20]
  %8 = bucket_unpack bucket=0 (%7) : f32[4,4], f32[4]
  %9 = input "y" : f32[3]
  %10 = gradient "u" (%9) : f32[3]
  %11 = grad_sync "u" reduce=mean group=g0 ready=0 (%10) after(%6) : f32[3] ; 12 B
  %12 = sync (%8#0, %8#1, %11)
}
"#;
    let g = parse(text).unwrap();
    assert_eq!(print(&g), text);
    assert_eq!(violations(text, None), "ok");
}

#[test]
fn printing_is_independent_of_node_indices() {
    let text = chain(&[
        G("a", "f32[4]", "mean", "g0"),
        G("b", "f32[4]", "sum", "g0"),
    ]);
    let g = parse(&text).unwrap();
    // Reparsing creates fresh indices; the text must not change.
    let again = parse(&print(&g)).unwrap();
    assert_eq!(print(&again), print(&g));
    assert_eq!(
        g.structural_hash().unwrap(),
        again.structural_hash().unwrap()
    );
}

#[test]
fn structural_hash_sees_shapes_not_ids() {
    let a = parse(&chain(&[G("a", "f32[4]", "mean", "g0")])).unwrap();
    let b = parse(&chain(&[G("a", "f32[5]", "mean", "g0")])).unwrap();
    assert_ne!(a.structural_hash().unwrap(), b.structural_hash().unwrap());
}

#[test]
fn parser_accepts_comments_blank_lines_and_forward_references() {
    let text = "; a comment\ngraph \"f\" {\n\n  group g0 size=2\n  %5 = sync (%1) ; the end\n  %1 = all_reduce reduce=sum group=g0 (%0) : f32[2]\n  %0 = input \"x\" : f32[2]\n}\n";
    let g = parse(text).unwrap();
    assert_eq!(
        roundtrip(&g),
        "graph \"f\" {\n  group g0 size=2\n  %0 = input \"x\" : f32[2]\n  %1 = all_reduce reduce=sum group=g0 (%0) : f32[2] ; 1 tensor, 8 B\n  %2 = sync (%1)\n}\n"
    );
}

#[test]
fn parse_errors_give_line_and_column() {
    let cases = [
        ("", "line 1, column 1: empty text"),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f33[2]\n}\n",
            "line 2, column 20: unknown dtype 'f33'",
        ),
        (
            "graph \"g\" {\n  %0 = frobnicate\n}\n",
            "line 2, column 8: unknown op 'frobnicate'",
        ),
        (
            "graph \"g\" {\n  %0 = sync (%7)\n}\n",
            "line 2, column 14: %7 is not defined",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n  %0 = input \"y\" : f32[2]\n}\n",
            "line 3, column 3: %0 is defined twice",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x : f32[2]\n}\n",
            "line 2, column 14: unterminated string",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n",
            "line 3, column 1: missing closing '}'",
        ),
        (
            "graph \"g\" {\n  %0 = compute \"c\" kind=matmul : f32[2]\n}\n",
            "line 2, column 8: 'compute' needs 'flops=...'",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n  %1 = all_reduce reduce=max group=g0 (%0) : f32[2]\n}\n",
            "line 3, column 26: unknown reduce op 'max'",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" size=3 : f32[2]\n}\n",
            "line 2, column 18: 'input' has no attribute 'size'",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n  %1 = sync (%0#3)\n}\n",
            "line 3, column 14: %0 has 1 result(s); #3 does not exist",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2] $\n}\n",
            "line 2, column 27: unexpected character '$'",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n  %1 = bucket_pack bucket=0 align=24 (%0) : f32[2]\n}\n",
            "line 3, column 35: align must be a power of two from 1 to 65536 bytes",
        ),
        (
            "graph \"g\" {\n  %0 = input \"x\" : f32[2]\n  %1 = bucket_unpack bucket=0 as=slices (%0) : f32[2]\n}\n",
            "line 3, column 34: 'as' must be views or copies",
        ),
    ];
    for (text, want) in cases {
        let err = parse(text)
            .err()
            .unwrap_or_else(|| panic!("parsed: {text}"))
            .to_string();
        assert!(
            err.starts_with(want),
            "for {text:?}\n got: {err}\nwant: {want}"
        );
    }
}

#[test]
fn verifier_reports_every_violation_with_its_line() {
    let text = r#"graph "bad" {
  group g0 size=4
  %0 = input "x" : f32[4]
  %1 = gradient "a" (%0) : f32[4]
  %2 = gradient "b" (%0) : bf16[4]
  %3 = all_reduce reduce=sum group=g0 bucket=0 (%1, %2) : f32[4], bf16[4]
  %4 = all_reduce reduce=sum group=g1 (%1) : f32[4]
  %5 = bucket_pack bucket=1 (%1) : f32[5]
  %6 = all_reduce_start reduce=sum group=g0 (%0) : f32[4]
  %7 = gradient "a" (%0) : f32[4]
  %8 = grad_sync "c" reduce=sum group=g0 ready=0 (%7) : f32[4]
  %9 = grad_sync "a" reduce=sum group=g0 ready=0 (%0) : f32[4]
  %10 = sync (%3#0, %4, %8)
}
"#;
    insta::assert_snapshot!(violations(text, None));
}

#[test]
fn verifier_checks_bucket_cap_and_dependent_members() {
    let text = r#"graph "cap" {
  group g0 size=4
  %0 = input "x" : f32[4]
  %1 = gradient "a" (%0) : f32[256]
  %2 = compute "from_a" kind=elementwise flops=1 (%1) : f32[256]
  %3 = gradient "b" (%2) : f32[256]
  %4 = gradient "c" (%0) : f32[256]
  %5 = all_reduce reduce=sum group=g0 bucket=0 (%1, %3, %4) : f32[256], f32[256], f32[256]
  %6 = sync (%5#0, %5#1, %5#2)
}
"#;
    let v = violations(text, Some(1024));
    assert!(v.contains("bucket member %3 depends on member %1"), "{v}");
    assert!(
        v.contains("bucket holds 2.00 KiB before its last member, over the cap of 1.00 KiB"),
        "{v}"
    );
    // Exactly at the cap with the closing tensor is legal; under it too.
    assert!(!violations(text, Some(2049)).contains("over the cap"));
}

#[test]
fn verifier_checks_start_done_pairing_and_unpack_types() {
    let text = r#"graph "pairs" {
  group g0 size=2
  %0 = input "x" : f32[4]
  %1 = gradient "a" (%0) : f32[4]
  %2 = bucket_pack bucket=0 (%1) : bf16[4]
  %3 = all_reduce_start reduce=sum group=g0 bucket=0 (%2) : bf16[4]
  %4 = all_reduce_done bucket=0 (%3) : bf16[4]
  %5 = all_reduce_done bucket=0 (%3) : bf16[4]
  %6 = bucket_unpack bucket=0 (%4) : bf16[4]
  %7 = sync (%6, %5)
}
"#;
    let v = violations(text, None);
    assert!(v.contains("exactly one all_reduce_done"), "{v}");
    assert!(v.contains("in the type it was packed from"), "{v}");
}

/// Found by the `graph_text` fuzz target (twice: with and without a sync point): a reduced
/// gradient read only by a compute nobody reads was accepted, and dead-code removal then left
/// it unread. It is lost either way, so the verifier now rejects the input.
#[test]
fn a_reduced_gradient_read_only_by_dead_compute_is_rejected() {
    let without_sync = r#"graph "dep" {
  group g0 size=4
  %0 = input "loss.grad" : f32[16]
  %1 = gradient "a" (%0) : f32[16]
  %2 = all_reduce reduce=mean group=g0 bucket=0 (%1) : f32[16]
  %3 = compute "uses_a" kind=elementwise flops=16 (%2) : f32[16]
}
"#;
    let v = violations(without_sync, None);
    assert!(
        v.contains("reduced result(s) [0] are never used (or only by dead code)"),
        "{v}"
    );
    let text = r#"graph "dep" {
  group g0 size=4
  %0 = input "loss.grad" : f32[16]
  %1 = gradient "a" (%0) : f32[16]
  %2 = all_reduce reduce=mean group=g0 bucket=0 (%1) : f32[16]
  %3 = compute "uses_a" kind=elementwise flops=16 (%2) : f32[16]
  %4 = sync (%0)
}
"#;
    let v = violations(text, None);
    assert!(
        v.contains("reduced result(s) [0] are never used (or only by dead code)")
            && v.contains("%2 = all_reduce"),
        "{v}"
    );
}

/// Found by the `graph_text` fuzz target: the verifier indexed the first operand of an
/// `all_reduce_done` that had none (`;` starts a comment, so the operands were commented out).
#[test]
fn an_all_reduce_done_without_operands_is_a_violation_not_a_panic() {
    let text = r#"graph "b" {
  group g0 size=4
  %0 = input "loss.grad" : f32[8]
  %1 = gradient "w" (%0) : f32[16]
  %2 = all_reduce_start reduce=mean group=g0 bucket=0 (%1) : f32[16]
  %3 = all_reduce_done; bucket=0 (%2) : f32[16]
  %4 = sync (%2)
}
"#;
    let v = violations(text, None);
    assert!(
        v.contains("all_reduce_done needs at least one operand"),
        "{v}"
    );
}

#[test]
fn a_pack_keeps_its_member_alignment_and_the_layout_honours_it() {
    // Three f32 members of 3, 100 and 5 elements, aligned to 512 bytes (128 elements).
    let text = |align: &str| {
        format!(
            r#"graph "views" {{
  group g0 size=2
  %0 = input "x" : f32[3]
  %1 = gradient "a" (%0) : f32[3]
  %2 = input "y" : f32[100]
  %3 = gradient "b" (%2) : f32[100]
  %4 = input "z" : f32[5]
  %5 = gradient "c" (%4) : f32[5]
  %6 = bucket_pack bucket=0 scale=1/2{align} (%1, %3, %5) : f32[108] ; 3 tensors, 432 B
  %7 = all_reduce reduce=sum group=g0 bucket=0 (%6) : f32[108] ; 1 tensor, 432 B
  %8 = bucket_unpack bucket=0 (%7) : f32[3], f32[100], f32[5]
  %9 = sync (%8#0, %8#1, %8#2)
}}
"#
        )
    };
    let wide = text(" align=512");
    let g = parse(&wide).unwrap();
    assert_eq!(print(&g), wide);
    assert_eq!(violations(&wide, None), "ok");
    let l = &collective_fusion::codegen::layout::bucket_layouts(&g).unwrap()[0];
    let offsets: Vec<u64> = l.members.iter().map(|m| m.offset).collect();
    assert_eq!(offsets, [0, 128, 256]);
    assert_eq!((l.numel, l.padding, l.bytes), (384, 276, 1536));
    // The default (16 bytes) is not printed, and packs members 4 elements apart.
    let narrow = parse(&text("")).unwrap();
    assert_eq!(print(&narrow), text(""));
    let l = &collective_fusion::codegen::layout::bucket_layouts(&narrow).unwrap()[0];
    let offsets: Vec<u64> = l.members.iter().map(|m| m.offset).collect();
    assert_eq!(offsets, [0, 4, 104]);
    // The alignment is part of the plan cache's key.
    assert_ne!(
        g.structural_hash().unwrap(),
        narrow.structural_hash().unwrap()
    );
}

#[test]
fn an_unpack_as_views_round_trips_and_may_not_cast() {
    let text = |wire: &str| {
        format!(
            r#"graph "v" {{
  group g0 size=2
  %0 = input "x" : f32[3]
  %1 = gradient "a" (%0) : f32[3]
  %2 = gradient "b" (%0) : f32[5]
  %3 = bucket_pack bucket=0 align=512 (%1, %2) : {wire}[8] ; 2 tensors, 32 B
  %4 = all_reduce reduce=sum group=g0 bucket=0 (%3) : {wire}[8] ; 1 tensor, {} B
  %5 = bucket_unpack bucket=0 as=views (%4) : f32[3], f32[5]
  %6 = sync (%5#0, %5#1)
}}
"#,
            if wire == "f32" { 32 } else { 16 }
        )
    };
    let same = text("f32");
    assert_eq!(print(&parse(&same).unwrap()), same);
    assert_eq!(violations(&same, None), "ok");
    // `as=copies` is the default, and not printed.
    let copies = same.replace(" as=views", " as=copies");
    assert_eq!(
        print(&parse(&copies).unwrap()),
        same.replace(" as=views", "")
    );
    let cast = violations(&text("bf16"), None);
    assert!(
        cast.contains("bucket_unpack as=views hands back members of the bucket's own dtype"),
        "{cast}"
    );
}

#[test]
fn a_dtype_is_serialized_as_its_text_form_name() {
    use collective_fusion::graph::DType;
    for d in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I64,
        DType::I32,
        DType::Bool,
    ] {
        let json = serde_json::to_string(&d).unwrap();
        assert_eq!(json, format!("\"{}\"", d.name()));
        assert_eq!(serde_json::from_str::<DType>(&json).unwrap(), d);
        assert_eq!(DType::from_name(d.name()), Some(d));
    }
    let e = serde_json::from_str::<DType>("\"f8\"").unwrap_err();
    assert!(e.to_string().contains("f8"), "{e}");
}
