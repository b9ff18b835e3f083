//! The command line's profile loaders on arbitrary bytes: the input split at its first NUL byte
//! is a model profile (JSON) and a link profile (JSON). Each loads to a profile or an error,
//! never a panic; a model and link that both load are profiled under every policy (which may
//! refuse with an error, never panic).
#![no_main]

use collective_fusion::config::{BucketPolicy, CompileConfig};
use collective_fusion::cost::{CostModel, SystemProfile};
use collective_fusion::graph::ReduceOp;
use collective_fusion::model::ModelProfile;
use collective_fusion::profile::{ProfileOptions, compare};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (model, link) = match data.iter().position(|b| *b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b""[..]),
    };
    let (Ok(model), Ok(link)) = (std::str::from_utf8(model), std::str::from_utf8(link)) else {
        return;
    };
    let model = ModelProfile::from_json("fuzz", model);
    let system = if link.is_empty() {
        Ok(CostModel::default().system)
    } else {
        SystemProfile::from_json("fuzz", link)
    };
    let (Ok(model), Ok(system)) = (model, system) else {
        return;
    };
    let opts = ProfileOptions {
        world: system.world,
        batch: 8,
        reduce: ReduceOp::Mean,
        config: CompileConfig {
            verify: true,
            cost: CostModel::new(system),
            ..CompileConfig::default()
        },
    };
    let _ = compare(&model, &opts, BucketPolicy::Cost, |_| {});
});
