//! The graph text parser on arbitrary bytes: it returns a graph or a positioned error, never
//! panics; a graph it returns prints to text that parses back to the same text; the verifier
//! and, on a graph the verifier accepts, the whole pass pipeline and the lowering run without
//! panicking (they may refuse with an error).
#![no_main]

use collective_fusion::codegen::plan::lower;
use collective_fusion::config::CompileConfig;
use collective_fusion::graph::parse::parse;
use collective_fusion::graph::print::print;
use collective_fusion::graph::verify::{VerifyOptions, verify};
use collective_fusion::passes::{CompileError, compile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut graph = match parse(text) {
        Ok(g) => g,
        Err(e) => {
            // Errors carry a position inside the input.
            assert!(e.line >= 1, "{e}");
            return;
        }
    };
    let printed = print(&graph);
    let reparsed = parse(&printed).unwrap_or_else(|e| panic!("{e}\n{printed}"));
    assert_eq!(print(&reparsed), printed);
    if verify(&graph, &VerifyOptions::default()).is_err() {
        return;
    }
    let config = CompileConfig {
        verify: true,
        ..CompileConfig::default()
    };
    match compile(&mut graph, &config) {
        Ok(_) => {
            let _ = lower(&graph);
        }
        // On an input the verifier accepted, a pass may refuse, but must not break an
        // invariant or lose a gradient.
        Err(e @ (CompileError::Verify { after: Some(_), .. } | CompileError::LostGradient { .. })) => {
            panic!("{e}\n{text}")
        }
        Err(_) => {}
    }
});
