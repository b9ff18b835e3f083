//! The models `run` trains, generic over any autodiff backend, so that the step benchmark
//! trains the very same models on Burn's backends alone.

use burn_backend::AutodiffBackend;
use burn_backend::distributed::DistributedBackend;
use burn_core::module::AutodiffModule;
use burn_core::tensor::Tensor;
use burn_nn::conv::{Conv2d, Conv2dConfig};
use burn_nn::{
    BatchNorm, BatchNormConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, PaddingConfig2d,
};

use crate::backend::{SyncBatchNorm, SyncBatchNormConfig};

/// Which model to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RunModel {
    /// 784 → `width` (× `hidden_layers`) → 10, ReLU (3 hidden layers of 1024 by default).
    Mlp {
        /// Hidden layers, `width` wide each.
        hidden_layers: usize,
        /// Width of every hidden layer.
        width: usize,
    },
    /// Two 3×3 convolutions (1 → 16 → 32 channels) on 28×28 inputs, then a linear layer to 10.
    ConvNet,
    /// A small residual convnet with BatchNorm, whose running statistics are buffers: a 3×3
    /// stem to 8 channels, `blocks` residual blocks (3×3 conv, BatchNorm, ReLU, 3×3 conv,
    /// BatchNorm, plus the block's input, ReLU) on 28×28 inputs, the mean over the image, and a
    /// linear layer to 10.
    ResNet {
        /// Residual blocks (2 by default).
        blocks: usize,
    },
    /// Many small tensors: each input row as 16 tokens of 49 features, embedded to width 64,
    /// `blocks` transformer-style blocks (pre-norm single-head self-attention with q/k/v/o
    /// projections, then a 64 → 256 → 64 GELU MLP, both residual; 16 parameter tensors of at
    /// most 64 KiB each per block), mean over tokens, a linear layer to 10.
    Blocks {
        /// Transformer-style blocks (12 by default).
        blocks: usize,
    },
}

impl RunModel {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            RunModel::Mlp { .. } => "mlp",
            RunModel::ConvNet => "convnet",
            RunModel::ResNet { .. } => "resnet",
            RunModel::Blocks { .. } => "blocks",
        }
    }
}

/// Features per input row of every model.
pub const INPUTS: usize = 784;
/// Values per output row of every model.
pub const OUTPUTS: usize = 10;

/// A model `run` trains: built for a [`RunModel`], mapping a batch of [`INPUTS`] features per
/// row to [`OUTPUTS`] values per row.
pub trait Net<Bk: AutodiffBackend>: AutodiffModule<Bk> + Clone + Send + 'static {
    /// A freshly initialised model (`model` picks the sizes of a model of this type).
    fn init(d: &Bk::Device, model: RunModel) -> Self;
    /// The forward pass of a batch `[rows, INPUTS]` to `[rows, OUTPUTS]`.
    fn forward(&self, x: Tensor<Bk, 2>) -> Tensor<Bk, 2>;
}

/// [`RunModel::Mlp`].
pub type Mlp<Bk> = Vec<Linear<Bk>>;

impl<Bk: AutodiffBackend> Net<Bk> for Mlp<Bk> {
    fn init(d: &Bk::Device, model: RunModel) -> Self {
        let (hidden, width) = match model {
            RunModel::Mlp {
                hidden_layers,
                width,
            } => (hidden_layers, width),
            _ => (3, 1024),
        };
        let widths: Vec<usize> = std::iter::once(INPUTS)
            .chain(std::iter::repeat_n(width, hidden))
            .chain(std::iter::once(OUTPUTS))
            .collect();
        widths
            .windows(2)
            .map(|w| LinearConfig::new(w[0], w[1]).init(d))
            .collect()
    }
    fn forward(&self, x: Tensor<Bk, 2>) -> Tensor<Bk, 2> {
        let mut h = x;
        for (i, l) in self.iter().enumerate() {
            h = l.forward(h);
            if i + 1 < self.len() {
                h = burn_core::tensor::activation::relu(h);
            }
        }
        h
    }
}

/// [`RunModel::ConvNet`].
pub type ConvNet<Bk> = (Conv2d<Bk>, Conv2d<Bk>, Linear<Bk>);

impl<Bk: AutodiffBackend> Net<Bk> for ConvNet<Bk> {
    fn init(d: &Bk::Device, _model: RunModel) -> Self {
        (
            Conv2dConfig::new([1, 16], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(d),
            Conv2dConfig::new([16, 32], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(d),
            LinearConfig::new(32 * INPUTS, OUTPUTS).init(d),
        )
    }
    fn forward(&self, x: Tensor<Bk, 2>) -> Tensor<Bk, 2> {
        let n = x.dims()[0];
        let h = x.reshape([n, 1, 28, 28]);
        let h = burn_core::tensor::activation::relu(self.0.forward(h));
        let h = burn_core::tensor::activation::relu(self.1.forward(h));
        self.2.forward(h.reshape([n, 32 * INPUTS]))
    }
}

/// Channels of [`RunModel::ResNet`].
const RES_CHANNELS: usize = 8;

/// The norm layer of [`RunModel::ResNet`]: Burn's `BatchNorm` (each rank's statistics), or
/// [`SyncBatchNorm`] (every rank's, `run --sync-bn`).
pub trait ChannelNorm<Bk: AutodiffBackend>: AutodiffModule<Bk> + Clone + Send + 'static {
    /// A fresh norm of `channels` on `d`.
    fn init(d: &Bk::Device, channels: usize) -> Self;
    /// Normalizes `[batch, channels, height, width]`.
    fn forward(&self, x: Tensor<Bk, 4>) -> Tensor<Bk, 4>;
}

impl<Bk: AutodiffBackend> ChannelNorm<Bk> for BatchNorm<Bk> {
    fn init(d: &Bk::Device, channels: usize) -> Self {
        BatchNormConfig::new(channels).init(d)
    }
    fn forward(&self, x: Tensor<Bk, 4>) -> Tensor<Bk, 4> {
        BatchNorm::forward(self, x)
    }
}

impl<Bk: AutodiffBackend + DistributedBackend> ChannelNorm<Bk> for SyncBatchNorm<Bk> {
    fn init(d: &Bk::Device, channels: usize) -> Self {
        SyncBatchNormConfig::new(channels).init(d)
    }
    fn forward(&self, x: Tensor<Bk, 4>) -> Tensor<Bk, 4> {
        SyncBatchNorm::forward(self, x)
    }
}

/// A residual block of [`RunModel::ResNet`]: conv, norm, conv, norm.
pub type ResBlock<Bk, N = BatchNorm<Bk>> = (Conv2d<Bk>, N, Conv2d<Bk>, N);

/// [`RunModel::ResNet`]: the stem (conv, norm), the residual blocks, the head.
pub type ResNet<Bk, N = BatchNorm<Bk>> = (Conv2d<Bk>, N, Vec<ResBlock<Bk, N>>, Linear<Bk>);

impl<Bk: AutodiffBackend, N: ChannelNorm<Bk>> Net<Bk> for ResNet<Bk, N> {
    fn init(d: &Bk::Device, model: RunModel) -> Self {
        let blocks = match model {
            RunModel::ResNet { blocks } => blocks,
            _ => 2,
        };
        let conv = |from: usize| {
            Conv2dConfig::new([from, RES_CHANNELS], [3, 3])
                .with_padding(PaddingConfig2d::Same)
                .init(d)
        };
        let norm = || N::init(d, RES_CHANNELS);
        (
            conv(1),
            norm(),
            (0..blocks)
                .map(|_| (conv(RES_CHANNELS), norm(), conv(RES_CHANNELS), norm()))
                .collect(),
            LinearConfig::new(RES_CHANNELS, OUTPUTS).init(d),
        )
    }
    fn forward(&self, x: Tensor<Bk, 2>) -> Tensor<Bk, 2> {
        use burn_core::tensor::activation::relu;
        let n = x.dims()[0];
        let mut h = relu(self.1.forward(self.0.forward(x.reshape([n, 1, 28, 28]))));
        for (conv1, norm1, conv2, norm2) in &self.2 {
            let inner = relu(norm1.forward(conv1.forward(h.clone())));
            h = relu(h + norm2.forward(conv2.forward(inner)));
        }
        let pooled: Tensor<Bk, 2> = h.mean_dim(3).mean_dim(2).reshape([n, RES_CHANNELS]);
        self.3.forward(pooled)
    }
}

/// Tokens per input row of [`RunModel::Blocks`], features per token, model width, MLP width.
const TOKENS: usize = 16;
const TOKEN_FEATURES: usize = INPUTS / TOKENS;
const WIDTH: usize = 64;
const MLP_WIDTH: usize = 4 * WIDTH;

/// One transformer-style block: norm, q, k, v, o, norm, MLP in, MLP out.
pub type Block<Bk> = (
    LayerNorm<Bk>,
    Linear<Bk>,
    Linear<Bk>,
    Linear<Bk>,
    Linear<Bk>,
    LayerNorm<Bk>,
    Linear<Bk>,
    Linear<Bk>,
);

/// Token embedding, the blocks, a final norm and the head.
pub type Blocks<Bk> = (Linear<Bk>, Vec<Block<Bk>>, LayerNorm<Bk>, Linear<Bk>);

impl<Bk: AutodiffBackend> Net<Bk> for Blocks<Bk> {
    fn init(d: &Bk::Device, model: RunModel) -> Self {
        let n = match model {
            RunModel::Blocks { blocks } => blocks,
            _ => 12,
        };
        let block = || {
            (
                LayerNormConfig::new(WIDTH).init(d),
                LinearConfig::new(WIDTH, WIDTH).init(d),
                LinearConfig::new(WIDTH, WIDTH).init(d),
                LinearConfig::new(WIDTH, WIDTH).init(d),
                LinearConfig::new(WIDTH, WIDTH).init(d),
                LayerNormConfig::new(WIDTH).init(d),
                LinearConfig::new(WIDTH, MLP_WIDTH).init(d),
                LinearConfig::new(MLP_WIDTH, WIDTH).init(d),
            )
        };
        (
            LinearConfig::new(TOKEN_FEATURES, WIDTH).init(d),
            (0..n).map(|_| block()).collect(),
            LayerNormConfig::new(WIDTH).init(d),
            LinearConfig::new(WIDTH, OUTPUTS).init(d),
        )
    }
    fn forward(&self, x: Tensor<Bk, 2>) -> Tensor<Bk, 2> {
        use burn_core::tensor::activation::{gelu, softmax};
        let n = x.dims()[0];
        let mut h = self.0.forward(x.reshape([n, TOKENS, TOKEN_FEATURES]));
        let scale = 1.0 / (WIDTH as f64).sqrt();
        for (norm1, q, k, v, o, norm2, fc1, fc2) in &self.1 {
            let a = norm1.forward(h.clone());
            let scores = q
                .forward(a.clone())
                .matmul(k.forward(a.clone()).swap_dims(1, 2));
            let attn = softmax(scores.mul_scalar(scale), 2).matmul(v.forward(a));
            h = h + o.forward(attn);
            let m = fc2.forward(gelu(fc1.forward(norm2.forward(h.clone()))));
            h = h + m;
        }
        let pooled: Tensor<Bk, 2> = self.2.forward(h).mean_dim(1).reshape([n, WIDTH]);
        self.3.forward(pooled)
    }
}
