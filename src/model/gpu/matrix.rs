//! A weight matrix on a device, dense or in packed blocks, and the matmul bound to it: what
//! the layers' projections and the LM head's vocabulary blocks share.

use crate::device::{Gpu, Tensor};
use crate::error::Result;
use crate::kernels::ops::{Bound, Matmul, MatmulIo, Params};
use crate::kernels::quant::{PackedMatrix, QuantIo, QuantMatmul};

/// A `[rows][cols]` matrix on a device: dense (f32 or f16), or packed blocks (a file's own,
/// or `--weights`).
pub(super) enum DeviceMatrix {
    Dense(Tensor),
    Packed(PackedMatrix),
}

/// A matmul bound to its operands: the dense one, or the one on packed blocks.
pub(super) enum Projection {
    Dense(Matmul),
    Packed(QuantMatmul),
}

impl AsRef<Bound> for Projection {
    fn as_ref(&self) -> &Bound {
        match self {
            Projection::Dense(m) => m.as_ref(),
            Projection::Packed(m) => m.as_ref(),
        }
    }
}

impl Projection {
    /// Binds `y = x w^T (+ bias)` for up to `rows` rows; `(n, k)`: `w`'s rows and columns.
    pub(super) fn bind(
        gpu: &Gpu,
        params: &mut Params,
        (x, w, bias, y): (&Tensor, &DeviceMatrix, Option<&Tensor>, &Tensor),
        (rows, n, k): (usize, usize, usize),
    ) -> Result<Self> {
        Ok(match w {
            DeviceMatrix::Dense(w) => {
                let io = MatmulIo { x, w, bias, y };
                Projection::Dense(Matmul::bind(gpu, params, io, (rows, n, k))?)
            }
            DeviceMatrix::Packed(w) => {
                let io = QuantIo { x, w, bias, y };
                Projection::Packed(QuantMatmul::bind(gpu, params, io, rows)?)
            }
        })
    }

    /// Marks a matmul on packed blocks as the LM head, which the integer-dot GEMVs never run
    /// ([`crate::kernels::quant::QuantRole::Logits`]); a dense one is unchanged.
    pub(super) fn for_logits(self) -> Self {
        match self {
            Projection::Packed(op) => Projection::Packed(op.for_logits()),
            dense => dense,
        }
    }

    /// Configures the op for `m` rows.
    pub(super) fn configure(&mut self, gpu: &Gpu, params: &mut Params, m: usize) -> Result<()> {
        match self {
            Projection::Dense(op) => op.configure(gpu, params, m),
            Projection::Packed(op) => op.configure(gpu, params, m),
        }
    }
}
