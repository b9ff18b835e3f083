//! Model profiles: parameter lists, per-layer backward FLOPs and the measured gradient-ready
//! order of real models (the files under `models/`, bundled into the binary).
//!
//! A profile is validated on load: shapes agree with element and byte counts, layer references
//! are in range, and the ready order is a permutation of the parameters. Every error names the
//! parameter or layer at fault.

use serde::Deserialize;
use thiserror::Error;

use crate::graph::DType;

/// The reference profiles shipped with the crate, by name.
pub const BUNDLED: &[(&str, &str)] = &[
    ("resnet50", include_str!("../models/resnet50.json")),
    ("vit_b_16", include_str!("../models/vit_b_16.json")),
    (
        "bert_base_uncased",
        include_str!("../models/bert_base_uncased.json"),
    ),
    ("gpt2", include_str!("../models/gpt2.json")),
    ("llama_1b", include_str!("../models/llama_1b.json")),
    (
        "llama_1b_tied",
        include_str!("../models/llama_1b_tied.json"),
    ),
];

/// Why a profile could not be loaded.
#[derive(Debug, Error)]
pub enum ModelError {
    /// Neither a bundled name nor a readable file.
    #[error(
        "model '{name}' is not a bundled profile ({known}) and could not be read as a file: {source}"
    )]
    NotFound {
        /// What was asked for.
        name: String,
        /// The bundled names.
        known: String,
        /// The file error.
        source: std::io::Error,
    },
    /// The JSON does not match the schema.
    #[error("model profile '{name}' is not valid JSON of the profile schema: {source}")]
    Json {
        /// Profile name or path.
        name: String,
        /// The decoding error.
        source: serde_json::Error,
    },
    /// The JSON decodes but its contents disagree with themselves.
    #[error("model profile '{name}': {message}")]
    Invalid {
        /// Profile name or path.
        name: String,
        /// What is inconsistent, naming the parameter or layer.
        message: String,
    },
}

/// A layer reference of a parameter: one layer, or several for a tied weight.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(untagged)]
pub enum LayerRef {
    /// Used by one layer.
    One(usize),
    /// Tied: used by several layers.
    Many(Vec<usize>),
}

impl LayerRef {
    /// The layers, in the order given.
    pub fn layers(&self) -> Vec<usize> {
        match self {
            LayerRef::One(l) => vec![*l],
            LayerRef::Many(v) => v.clone(),
        }
    }
}

/// One parameter.
#[derive(Clone, Debug, Deserialize)]
pub struct ParamInfo {
    /// Index in registration order.
    pub i: usize,
    /// Fully qualified name.
    pub name: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Number of elements.
    pub numel: u64,
    /// Bytes at the profile's dtype.
    pub bytes: u64,
    /// Layer(s) that use it.
    pub layer: LayerRef,
}

/// One layer, in forward order.
#[derive(Clone, Debug, Deserialize)]
pub struct LayerInfo {
    /// Module name.
    pub name: String,
    /// Module type (`Linear`, `Conv2d`, ...).
    #[serde(rename = "type")]
    pub kind: String,
    /// Parameters it owns.
    pub params: Vec<usize>,
    /// Input shape at batch 1.
    pub in_shape: Vec<u64>,
    /// Output shape at batch 1.
    pub out_shape: Vec<u64>,
    /// Backward FLOPs for one sample (dgrad + wgrad + attached).
    pub bwd_flops: u64,
}

/// A model profile.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelProfile {
    /// Model name.
    pub model: String,
    /// Parameter dtype (`f32`).
    pub dtype: String,
    /// Parameters in registration order.
    pub params: Vec<ParamInfo>,
    /// Layers in forward order.
    pub layers: Vec<LayerInfo>,
    /// Parameter indices in the order their gradients became ready.
    pub grad_ready_order: Vec<usize>,
}

impl ModelProfile {
    /// Loads a bundled profile by name (`gpt2`), or any profile file by path.
    pub fn load(name_or_path: &str) -> Result<Self, ModelError> {
        if let Some((_, text)) = BUNDLED.iter().find(|(n, _)| *n == name_or_path) {
            return Self::from_json(name_or_path, text);
        }
        let text =
            std::fs::read_to_string(name_or_path).map_err(|source| ModelError::NotFound {
                name: name_or_path.to_string(),
                known: BUNDLED
                    .iter()
                    .map(|(n, _)| *n)
                    .collect::<Vec<_>>()
                    .join(", "),
                source,
            })?;
        Self::from_json(name_or_path, &text)
    }

    /// Decodes and validates a profile.
    pub fn from_json(name: &str, text: &str) -> Result<Self, ModelError> {
        let p: ModelProfile = serde_json::from_str(text).map_err(|source| ModelError::Json {
            name: name.to_string(),
            source,
        })?;
        p.validate().map_err(|message| ModelError::Invalid {
            name: name.to_string(),
            message,
        })?;
        Ok(p)
    }

    /// The parameter dtype.
    pub fn dtype(&self) -> DType {
        DType::from_name(&self.dtype).unwrap_or(DType::F32)
    }

    /// Total parameter bytes.
    pub fn total_bytes(&self) -> u64 {
        self.params
            .iter()
            .fold(0u64, |a, p| a.saturating_add(p.bytes))
    }

    /// The layer whose backward makes a parameter's gradient final: for a tied weight, the one
    /// that runs last in backward, which is the first in forward order.
    pub fn final_layer(&self, param: usize) -> usize {
        self.params[param]
            .layer
            .layers()
            .into_iter()
            .min()
            .unwrap_or(0)
    }

    fn validate(&self) -> Result<(), String> {
        let dtype = DType::from_name(&self.dtype)
            .ok_or_else(|| format!("unknown dtype '{}'", self.dtype))?;
        if self.params.is_empty() {
            return Err("the profile has no parameters".into());
        }
        for (k, p) in self.params.iter().enumerate() {
            if p.i != k {
                return Err(format!(
                    "parameter '{}' has i={} at position {k}",
                    p.name, p.i
                ));
            }
            let Some(numel) = p.shape.iter().try_fold(1u64, |a, d| a.checked_mul(*d)) else {
                return Err(format!(
                    "parameter '{}': shape {:?} has more elements than fit in 64 bits",
                    p.name, p.shape
                ));
            };
            if numel != p.numel || numel.checked_mul(dtype.size()) != Some(p.bytes) {
                return Err(format!(
                    "parameter '{}': shape {:?} gives {numel} elements, but numel={} bytes={}",
                    p.name, p.shape, p.numel, p.bytes
                ));
            }
            let layers = p.layer.layers();
            if layers.is_empty() {
                return Err(format!("parameter '{}' names no layer", p.name));
            }
            if let Some(l) = layers.iter().find(|l| **l >= self.layers.len()) {
                return Err(format!(
                    "parameter '{}' names layer {l}, but there are {} layers",
                    p.name,
                    self.layers.len()
                ));
            }
        }
        for l in &self.layers {
            for (what, shape) in [("in_shape", &l.in_shape), ("out_shape", &l.out_shape)] {
                let bytes = shape
                    .iter()
                    .try_fold(dtype.size(), |a, d| a.checked_mul(*d));
                if bytes.is_none() {
                    return Err(format!(
                        "layer '{}': {what} {shape:?} has more bytes than fit in 64 bits",
                        l.name
                    ));
                }
            }
        }
        let mut seen = vec![false; self.params.len()];
        for &i in &self.grad_ready_order {
            match seen.get_mut(i) {
                None => {
                    return Err(format!(
                        "grad_ready_order names parameter {i}, out of range"
                    ));
                }
                Some(true) => return Err(format!("grad_ready_order names parameter {i} twice")),
                Some(s) => *s = true,
            }
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return Err(format!(
                "grad_ready_order misses parameter {i} ('{}')",
                self.params[i].name
            ));
        }
        let mut last = usize::MAX;
        for &i in &self.grad_ready_order {
            let l = self.final_layer(i);
            if l > last {
                return Err(format!(
                    "grad_ready_order puts '{}' (layer {l}) after a parameter of layer {last}, \
                     which backward order forbids",
                    self.params[i].name
                ));
            }
            last = l;
        }
        Ok(())
    }
}
