//! The compiler's configuration: one struct, settable in code, and the one place that reads
//! the compiler's environment variables (below). The process group's variables (`RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`, as a launcher such as `torchrun`
//! sets them, and `CF_RENDEZVOUS_TIMEOUT_MS`, `CF_RENDEZVOUS_TOKEN`) are read in one place too:
//! [`RendezvousConfig::from_env`](crate::runtime::rendezvous::RendezvousConfig::from_env), with a
//! malformed value an error naming the variable, as here.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `CF_BUCKET_POLICY` | `per-param`, `ddp` or `cost` | `ddp` |
//! | `CF_BUCKET_CAP_MB` | bucket cap in MiB (PyTorch's `bucket_cap_mb`) | 25 |
//! | `CF_FIRST_BUCKET_MB` | cap of the first bucket in MiB | 1 |
//! | `CF_OVERLAP` | `1`/`0`: split collectives and schedule them to overlap backward | 1 |
//! | `CF_REDUCE_DTYPE` | cast buckets to `bf16`/`f16`/`f32` for the all-reduce | none |
//! | `CF_PACK_ALIGN` | member alignment in a packed bucket, bytes (a power of two) | 16 |
//! | `CF_HOIST_MB` | MiB that ops deferred behind a gradient's producers may keep alive (`hoist-producers`); `0` keeps program order | 256 |
//! | `CF_BUCKET_VIEW` | `1`/`0`: reduced gradients as views of their bucket (DDP's `gradient_as_bucket_view`) | 0 |
//! | `CF_LINK` | system profile for the cost model (name or file) | `h200-nvlink` |
//! | `CF_VERIFY` | `1`/`0`: verify after every pass that changed something | on in debug builds |
//! | `CF_PRINT_AFTER` | `all` or `change`: keep the graph text after passes | off |
//! | `CF_DISABLE_PASSES` | comma-separated pass names to skip | none |

use thiserror::Error;

use crate::cost::{CostModel, LinkError, SystemProfile};
use crate::graph::DType;

/// One mebibyte.
pub const MIB: u64 = 1024 * 1024;

/// How gradients are grouped into buckets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BucketPolicy {
    /// One collective per parameter, as Burn does today.
    PerParam,
    /// PyTorch DDP's greedy rule: limits `[first, cap, cap, ...]`, a bucket closes once it
    /// reaches its limit, a tensor is never split.
    Ddp,
    /// Boundaries chosen to minimise predicted exposed communication under the cost model.
    Cost,
}

impl BucketPolicy {
    /// Parses `per-param`, `ddp` or `cost` (`none` is accepted for `per-param`).
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "per-param" | "none" => BucketPolicy::PerParam,
            "ddp" => BucketPolicy::Ddp,
            "cost" => BucketPolicy::Cost,
            _ => return None,
        })
    }

    /// The name `parse` accepts.
    pub fn name(self) -> &'static str {
        match self {
            BucketPolicy::PerParam => "per-param",
            BucketPolicy::Ddp => "ddp",
            BucketPolicy::Cost => "cost",
        }
    }
}

/// Options of the `bucket-gradients` pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BucketConfig {
    /// Grouping rule.
    pub policy: BucketPolicy,
    /// Byte limit of every bucket after the first.
    pub cap_bytes: u64,
    /// Byte limit of the first bucket of each key (DDP policy).
    pub first_bucket_bytes: u64,
}

impl Default for BucketConfig {
    fn default() -> Self {
        BucketConfig {
            policy: BucketPolicy::Ddp,
            cap_bytes: 25 * MIB,
            first_bucket_bytes: MIB,
        }
    }
}

/// When the pass manager keeps the graph text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum PrintAfter {
    /// Never.
    #[default]
    Never,
    /// After every pass.
    All,
    /// After every pass that changed the graph.
    Change,
}

/// Everything the compiler can be told.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileConfig {
    /// Bucketing.
    pub bucket: BucketConfig,
    /// Split collectives into start/done and schedule them to overlap compute.
    pub overlap: bool,
    /// Cast buckets to this dtype for the all-reduce (and back after).
    pub reduce_dtype: Option<DType>,
    /// Every member of a packed bucket starts at a multiple of this many bytes (a power of
    /// two; 16 by default; `gradient_as_bucket_view` raises it to 512).
    pub pack_align_bytes: u32,
    /// PyTorch DDP's `gradient_as_bucket_view`: a reduced gradient is handed back as a view of
    /// its reduced bucket (`bucket_unpack ... as=views`), not copied out of it, when nothing
    /// was cast. On a device that saves the unpack kernel, and the bucket's gradients are not
    /// held twice while it is unpacked; the host path still copies. Off by default, as in DDP.
    pub gradient_as_bucket_view: bool,
    /// `hoist-producers`: the most bytes that ops deferred behind a gradient's producers may
    /// keep alive (0: backward runs in program order). The Burn backend's lazy queue follows
    /// the same rule with the same bound when it forces a gradient. 256 MiB by default.
    pub hoist_bytes: u64,
    /// The cost model the `cost` policy and the simulator use.
    pub cost: CostModel,
    /// Verify the input and the graph after every pass that changed it.
    pub verify: bool,
    /// Keep graph text after passes.
    pub print_after: PrintAfter,
    /// Pass names to skip.
    pub disabled_passes: Vec<String>,
}

impl Default for CompileConfig {
    fn default() -> Self {
        CompileConfig {
            bucket: BucketConfig::default(),
            overlap: true,
            reduce_dtype: None,
            pack_align_bytes: crate::graph::PACK_ALIGN_BYTES,
            gradient_as_bucket_view: false,
            hoist_bytes: 256 << 20,
            cost: CostModel::default(),
            verify: cfg!(debug_assertions),
            print_after: PrintAfter::Never,
            disabled_passes: Vec::new(),
        }
    }
}

/// A configuration value could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// An environment variable holds a value it cannot take.
    #[error("environment variable {var}={value:?}: {expected}")]
    BadEnv {
        /// Variable name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it accepts.
        expected: &'static str,
    },
    /// The link profile could not be loaded.
    #[error(transparent)]
    Link(#[from] LinkError),
}

/// Parses a size in MiB (fractions allowed) into bytes.
pub fn mib_to_bytes(s: &str) -> Option<u64> {
    let v: f64 = s.trim().parse().ok()?;
    (v.is_finite() && v > 0.0).then(|| (v * MIB as f64).round() as u64)
}

fn parse_bool(s: &str) -> Option<bool> {
    match s.trim() {
        "1" | "true" | "on" | "yes" => Some(true),
        "0" | "false" | "off" | "no" => Some(false),
        _ => None,
    }
}

/// Field by field (the cost model's numbers by their bits), so that equal configurations hash
/// alike: with [`PartialEq`] it keys the plan cache.
impl std::hash::Hash for CompileConfig {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // Destructured: a new field does not compile until it is hashed here.
        let CompileConfig {
            bucket,
            overlap,
            reduce_dtype,
            pack_align_bytes,
            gradient_as_bucket_view,
            hoist_bytes,
            cost,
            verify,
            print_after,
            disabled_passes,
        } = self;
        bucket.hash(h);
        overlap.hash(h);
        reduce_dtype.hash(h);
        pack_align_bytes.hash(h);
        gradient_as_bucket_view.hash(h);
        hoist_bytes.hash(h);
        let crate::cost::SystemProfile {
            name,
            description,
            world,
            alpha_us,
            alpha_busy_us,
            interference_us,
            busy_shift_us,
            busbw_gbs,
            compute_tflops,
            mem_gbs,
            sources,
        } = &cost.system;
        (name, description, world, sources).hash(h);
        for x in [alpha_us, busbw_gbs, compute_tflops, mem_gbs] {
            x.to_bits().hash(h);
        }
        alpha_busy_us.map(f64::to_bits).hash(h);
        interference_us.map(f64::to_bits).hash(h);
        busy_shift_us.map(f64::to_bits).hash(h);
        verify.hash(h);
        print_after.hash(h);
        disabled_passes.hash(h);
    }
}

impl CompileConfig {
    /// The defaults, overridden by any `CF_*` environment variables that are set.
    pub fn from_env() -> Result<Self, ConfigError> {
        Self::default().with_vars(|k| std::env::var(k).ok())
    }

    /// Applies overrides from a variable lookup (the environment, or a map in tests).
    pub fn with_vars(
        mut self,
        get: impl Fn(&'static str) -> Option<String>,
    ) -> Result<Self, ConfigError> {
        let bad = |var: &'static str, value: &str, expected: &'static str| ConfigError::BadEnv {
            var,
            value: value.to_string(),
            expected,
        };
        if let Some(v) = get("CF_BUCKET_POLICY") {
            self.bucket.policy = BucketPolicy::parse(v.trim())
                .ok_or_else(|| bad("CF_BUCKET_POLICY", &v, "one of per-param, ddp, cost"))?;
        }
        if let Some(v) = get("CF_BUCKET_CAP_MB") {
            self.bucket.cap_bytes =
                mib_to_bytes(&v).ok_or_else(|| bad("CF_BUCKET_CAP_MB", &v, "a positive number"))?;
        }
        if let Some(v) = get("CF_FIRST_BUCKET_MB") {
            self.bucket.first_bucket_bytes = mib_to_bytes(&v)
                .ok_or_else(|| bad("CF_FIRST_BUCKET_MB", &v, "a positive number"))?;
        }
        if let Some(v) = get("CF_OVERLAP") {
            self.overlap = parse_bool(&v).ok_or_else(|| bad("CF_OVERLAP", &v, "1 or 0"))?;
        }
        if let Some(v) = get("CF_REDUCE_DTYPE") {
            let d = DType::from_name(v.trim())
                .filter(|d| d.is_float())
                .ok_or_else(|| bad("CF_REDUCE_DTYPE", &v, "one of f32, bf16, f16, f64"))?;
            self.reduce_dtype = Some(d);
        }
        if let Some(v) = get("CF_PACK_ALIGN") {
            self.pack_align_bytes = v
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|&n| crate::graph::pack_align_ok(n))
                .map(|n| n as u32)
                .ok_or_else(|| {
                    bad(
                        "CF_PACK_ALIGN",
                        &v,
                        "a power of two of bytes, from 1 to 65536",
                    )
                })?;
        }
        if let Some(v) = get("CF_HOIST_MB") {
            self.hoist_bytes = match v.trim().parse::<f64>() {
                Ok(0.0) => 0,
                _ => mib_to_bytes(&v)
                    .ok_or_else(|| bad("CF_HOIST_MB", &v, "a number of MiB, 0 or more"))?,
            };
        }
        if let Some(v) = get("CF_BUCKET_VIEW") {
            self.gradient_as_bucket_view =
                parse_bool(&v).ok_or_else(|| bad("CF_BUCKET_VIEW", &v, "1 or 0"))?;
        }
        if let Some(v) = get("CF_LINK") {
            self.cost = CostModel::new(SystemProfile::load(v.trim())?);
        }
        if let Some(v) = get("CF_VERIFY") {
            self.verify = parse_bool(&v).ok_or_else(|| bad("CF_VERIFY", &v, "1 or 0"))?;
        }
        if let Some(v) = get("CF_PRINT_AFTER") {
            self.print_after = match v.trim() {
                "all" => PrintAfter::All,
                "change" => PrintAfter::Change,
                "never" | "" => PrintAfter::Never,
                _ => return Err(bad("CF_PRINT_AFTER", &v, "all, change or never")),
            };
        }
        if let Some(v) = get("CF_DISABLE_PASSES") {
            self.disabled_passes = v
                .split(',')
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .collect();
        }
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(var: &'static str, value: &str) -> Result<CompileConfig, ConfigError> {
        CompileConfig::default().with_vars(|k| (k == var).then(|| value.to_string()))
    }

    #[test]
    fn the_hoist_bound_is_mib_zero_turns_it_off_and_garbage_is_named() {
        assert_eq!(CompileConfig::default().hoist_bytes, 256 * MIB);
        assert_eq!(with("CF_HOIST_MB", "0").unwrap().hoist_bytes, 0);
        assert_eq!(
            with("CF_HOIST_MB", " 1.5 ").unwrap().hoist_bytes,
            3 * MIB / 2
        );
        for bad in ["-1", "lots", "inf"] {
            let e = with("CF_HOIST_MB", bad).unwrap_err().to_string();
            assert!(e.contains("CF_HOIST_MB") && e.contains(bad), "{e}");
        }
    }
}
