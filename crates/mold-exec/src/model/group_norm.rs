//! GroupNorm and RMS norm over the channels (each optionally followed by SiLU), nearest 2×
//! up-sampling and the interleaving of four phase images into one of twice the size, over
//! channels-last `(n, h, w, c)` activations: the FLUX and Qwen-Image autoencoder decoders'
//! passes between their convolutions.
//!
//! On CUDA, for bf16/f16 with `c` a multiple of 8 and `c / 8` dividing 256, mold's kernels
//! (`kernels/groupnorm.cu`) run them: a group's statistics in f32 through a two-level
//! reduction (Chan's merge of count, mean and squared deviations), then one pass that
//! normalises, scales, shifts, applies SiLU and rounds once; the RMS norm as a warp per
//! pixel (`c` ≤ 512). Elsewhere — CPU, f32, other
//! channel counts, `MOLD_KERNELS=candle` — the same maths runs as candle ops (the reference
//! the kernels are tested against).

use super::ops::Kernels;
use candle_core::{DType, Tensor};

type CResult<T> = candle_core::Result<T>;

/// Checks shapes: `x` `(n, h, w, c)`, `groups` dividing `c`, `gamma` and `beta` `(c)`.
fn check(x: &Tensor, gamma: &Tensor, beta: &Tensor, groups: usize) -> CResult<usize> {
    let (_, _, _, c) = x.dims4()?;
    if groups == 0 || !c.is_multiple_of(groups) {
        candle_core::bail!("group norm: {groups} groups do not divide {c} channels");
    }
    for (name, t) in [("gamma", gamma), ("beta", beta)] {
        if t.dims() != [c] {
            candle_core::bail!("group norm: {name} is {:?}, expected [{c}]", t.dims());
        }
    }
    Ok(c)
}

/// Whether `x` has the layout mold's kernels take: contiguous, 16-byte aligned, 8-channel
/// vectors, `c / 8` dividing a block of 256 threads.
fn layout_ok(x: &Tensor, c: usize) -> bool {
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && x.is_contiguous()
        && (x.layout().start_offset() * x.dtype().size_in_bytes()).is_multiple_of(16)
        && c.is_multiple_of(8)
        && c / 8 <= 256
        && 256 % (c / 8) == 0
        && x.dims4()
            .is_ok_and(|(_, h, w, _)| h * w * c / 8 <= i32::MAX as usize)
}

/// `silu?(group_norm(x) · gamma + beta)` over `x` `(n, h, w, c)`, `groups` groups of
/// consecutive channels, `eps` added to the variance; `gamma`, `beta` `(c)`.
pub fn group_norm_nhwc(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    groups: usize,
    eps: f32,
    silu: bool,
    k: Kernels,
) -> CResult<Tensor> {
    let c = check(x, gamma, beta, groups)?;
    let params_ok = [gamma, beta]
        .iter()
        .all(|t| t.dtype() == x.dtype() && t.is_contiguous() && t.device().same_device(x.device()));
    if k.use_fused(layout_ok(x, c) && params_ok, "group norm")? {
        return cuda::group_norm(x, gamma, beta, groups, eps, silu);
    }
    group_norm_candle(x, gamma, beta, groups, eps, silu)
}

/// [`group_norm_nhwc`] as candle ops: statistics in f32 (mean, then the mean squared
/// deviation), normalised, scaled and shifted in f32, rounded once to `x`'s dtype.
pub fn group_norm_candle(
    x: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    groups: usize,
    eps: f32,
    silu: bool,
) -> CResult<Tensor> {
    let c = check(x, gamma, beta, groups)?;
    let (n, h, w, _) = x.dims4()?;
    let cpg = c / groups;
    let count = (h * w * cpg) as f64;
    let xf = x.to_dtype(DType::F32)?.reshape((n, h * w, groups, cpg))?;
    let mean = (xf.sum_keepdim(3)?.sum_keepdim(1)? / count)?;
    let d = xf.broadcast_sub(&mean)?;
    let var = (d.sqr()?.sum_keepdim(3)?.sum_keepdim(1)? / count)?;
    let y = d
        .broadcast_div(&(var + eps as f64)?.sqrt()?)?
        .reshape((n, h, w, c))?
        .broadcast_mul(&gamma.to_dtype(DType::F32)?)?
        .broadcast_add(&beta.to_dtype(DType::F32)?)?;
    let y = if silu { y.silu()? } else { y };
    y.to_dtype(x.dtype())
}

/// The statistics of each (image, group) of `x` `(n, h, w, c)` over its pixels: `(n, groups,
/// 3)` f32 of element count, mean and sum of squared deviations from the mean. A decoder split
/// into row bands takes them on each band's device, merges them across bands
/// ([`merge_group_stats`]) and normalises every band with the same coefficients
/// ([`norm_coefficients`], [`group_norm_apply_nhwc`]): the whole image's group norm.
pub fn group_stats_nhwc(x: &Tensor, groups: usize, k: Kernels) -> CResult<Tensor> {
    let (n, h, w, c) = x.dims4()?;
    if groups == 0 || !c.is_multiple_of(groups) {
        candle_core::bail!("group norm: {groups} groups do not divide {c} channels");
    }
    if k.use_fused(layout_ok(x, c), "group norm")? {
        return cuda::group_stats(x, groups);
    }
    let cpg = c / groups;
    let count = (h * w * cpg) as f64;
    let xf = x.to_dtype(DType::F32)?.reshape((n, h * w, groups, cpg))?;
    let mean = (xf.sum_keepdim(3)?.sum_keepdim(1)? / count)?;
    let m2 = xf
        .broadcast_sub(&mean)?
        .sqr()?
        .sum_keepdim(3)?
        .sum_keepdim(1)?
        .reshape((n, groups, 1))?;
    let mean = mean.reshape((n, groups, 1))?;
    let cnt = Tensor::full(count as f32, (n, groups, 1), x.device())?;
    Tensor::cat(&[cnt, mean, m2], 2)
}

/// Merges per-band statistics (each `(n, groups, 3)` as [`group_stats_nhwc`] wrote them,
/// flattened) with Chan's formula in f64: the statistics of all bands together.
pub fn merge_group_stats(parts: &[Vec<f32>]) -> CResult<Vec<f64>> {
    let Some(first) = parts.first() else {
        candle_core::bail!("group norm: no statistics to merge");
    };
    if !first.len().is_multiple_of(3) || parts.iter().any(|p| p.len() != first.len()) {
        candle_core::bail!("group norm: band statistics of different shapes");
    }
    let mut out: Vec<f64> = first.iter().map(|&v| v as f64).collect();
    for p in &parts[1..] {
        for (o, q) in out.chunks_exact_mut(3).zip(p.chunks_exact(3)) {
            let (na, ma, sa) = (o[0], o[1], o[2]);
            let (nb, mb, sb) = (q[0] as f64, q[1] as f64, q[2] as f64);
            let n = na + nb;
            if n == 0.0 {
                continue;
            }
            let d = mb - ma;
            o[0] = n;
            o[1] = ma + d * nb / n;
            o[2] = sa + sb + d * d * na * nb / n;
        }
    }
    Ok(out)
}

/// `(a, b)` per image and channel with `group_norm(x) · gamma + beta = x · a + b`, from merged
/// statistics `(n, groups, 3)` ([`merge_group_stats`]): `(n, c, 2)` f32, flattened.
pub fn norm_coefficients(
    stats: &[f64],
    gamma: &[f32],
    beta: &[f32],
    groups: usize,
    eps: f32,
) -> CResult<Vec<f32>> {
    let c = gamma.len();
    if groups == 0 || !c.is_multiple_of(groups) || beta.len() != c {
        candle_core::bail!(
            "group norm: {groups} groups, {c} scales and {} shifts",
            beta.len()
        );
    }
    if !stats.len().is_multiple_of(groups * 3) {
        candle_core::bail!("group norm: statistics are not (n, {groups}, 3)");
    }
    let n = stats.len() / (groups * 3);
    let cpg = c / groups;
    let mut ab = Vec::with_capacity(n * c * 2);
    for i in 0..n {
        for ch in 0..c {
            let s = &stats[(i * groups + ch / cpg) * 3..][..3];
            let var = if s[0] > 0.0 { s[2] / s[0] } else { 0.0 };
            let a = gamma[ch] as f64 / (var + eps as f64).sqrt();
            ab.push(a as f32);
            ab.push((beta[ch] as f64 - s[1] * a) as f32);
        }
    }
    Ok(ab)
}

/// `(a, b)` `(n, c, 2)` f32 on `gamma`'s device from `stats` `(k, n, groups, 3)`: the
/// statistics of `k` row bands ([`group_stats_nhwc`] on each, gathered on this device), merged
/// in f64 in band order. On CUDA (bf16/f16 parameters) one small kernel does it on the
/// device, so no band waits for the host; elsewhere [`merge_group_stats`] and
/// [`norm_coefficients`] on the host.
pub fn group_norm_coefficients_nhwc(
    stats: &Tensor,
    gamma: &Tensor,
    beta: &Tensor,
    eps: f32,
    k: Kernels,
) -> CResult<Tensor> {
    let (bands, n, groups, three) = stats.dims4()?;
    let c = gamma.dim(0)?;
    if three != 3 || bands == 0 || groups == 0 || !c.is_multiple_of(groups) || beta.dims() != [c] {
        candle_core::bail!(
            "group norm: statistics {:?} and parameters {:?}/{:?} do not match",
            stats.dims(),
            gamma.dims(),
            beta.dims()
        );
    }
    let on_device = cfg!(feature = "cuda")
        && stats.device().is_cuda()
        && stats.dtype() == DType::F32
        && stats.is_contiguous()
        && [gamma, beta].iter().all(|t| {
            matches!(t.dtype(), DType::BF16 | DType::F16)
                && t.dtype() == gamma.dtype()
                && t.is_contiguous()
                && t.device().same_device(stats.device())
        });
    if k.use_fused(on_device, "group norm")? {
        return cuda::merge_ab(stats, gamma, beta, eps);
    }
    let parts: Vec<Vec<f32>> = (0..bands)
        .map(|b| stats.get(b)?.flatten_all()?.to_vec1::<f32>())
        .collect::<CResult<_>>()?;
    let host = |t: &Tensor| t.to_dtype(DType::F32)?.to_vec1::<f32>();
    let ab = norm_coefficients(
        &merge_group_stats(&parts)?,
        &host(gamma)?,
        &host(beta)?,
        groups,
        eps,
    )?;
    Tensor::from_vec(ab, (n, c, 2), gamma.device())
}

/// `silu?(x · a + b)` per channel over `x` `(n, h, w, c)`, with `ab` `(n, c, 2)` f32 from
/// [`norm_coefficients`] on `x`'s device: a group norm whose statistics came from elsewhere.
pub fn group_norm_apply_nhwc(x: &Tensor, ab: &Tensor, silu: bool, k: Kernels) -> CResult<Tensor> {
    let (n, _, _, c) = x.dims4()?;
    if ab.dims() != [n, c, 2] || ab.dtype() != DType::F32 {
        candle_core::bail!(
            "group norm: coefficients {:?} {:?}, expected [{n}, {c}, 2] f32",
            ab.dims(),
            ab.dtype()
        );
    }
    let ab_ok = ab.is_contiguous()
        && ab.layout().start_offset() == 0
        && ab.device().same_device(x.device());
    if k.use_fused(layout_ok(x, c) && ab_ok, "group norm")? {
        return cuda::group_norm_apply(x, ab, silu);
    }
    let a = ab.narrow(2, 0, 1)?.reshape((n, 1, 1, c))?;
    let b = ab.narrow(2, 1, 1)?.reshape((n, 1, 1, c))?;
    let y = x
        .to_dtype(DType::F32)?
        .broadcast_mul(&a)?
        .broadcast_add(&b)?;
    let y = if silu { y.silu()? } else { y };
    y.to_dtype(x.dtype())
}

/// `x / rms(x) · gamma` over the last dimension of `x` (`c` channels; `eps` added to the
/// mean square), then SiLU where `silu`: Qwen-Image's VAE norm (`x / ‖x‖₂ · √c · γ`). One
/// pass on CUDA (bf16/f16, `c` a multiple of 8 up to 512, `gamma` `(c)` in `x`'s dtype),
/// else candle's row norm and SiLU.
pub fn rms_norm_channels(
    x: &Tensor,
    gamma: &Tensor,
    eps: f32,
    silu: bool,
    k: Kernels,
) -> CResult<Tensor> {
    let c = x.dim(candle_core::D::Minus1)?;
    if gamma.dims() != [c] {
        candle_core::bail!("rms norm: gamma is {:?}, expected [{c}]", gamma.dims());
    }
    let aligned = |t: &Tensor| {
        t.is_contiguous()
            && (t.layout().start_offset() * t.dtype().size_in_bytes()).is_multiple_of(16)
    };
    let supported = cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F16)
        && gamma.dtype() == x.dtype()
        && aligned(x)
        && aligned(gamma)
        && c.is_multiple_of(8)
        && c <= 512;
    if k.use_fused(supported, "channel RMS norm")? {
        return cuda::rms_channels(x, gamma, eps, silu);
    }
    let y = candle_nn::ops::rms_norm(x, gamma, eps)?;
    if silu {
        candle_nn::ops::silu(&y)
    } else {
        Ok(y)
    }
}

/// Nearest-neighbour 2× up-sampling of `x` `(n, h, w, c)` to `(n, 2h, 2w, c)`.
pub fn upsample2x_nhwc(x: &Tensor, k: Kernels) -> CResult<Tensor> {
    let (n, h, w, c) = x.dims4()?;
    if k.use_fused(layout_ok(x, c), "2x up-sampling")? {
        return cuda::upsample2x(x);
    }
    x.reshape((n, h, 1, w, 1, c))?
        .broadcast_as((n, h, 2, w, 2, c))?
        .contiguous()?
        .reshape((n, 2 * h, 2 * w, c))
}

/// `y[n, 2i + a, 2j + b] = p[2a + b][n, i, j]` for four `(n, h, w, c)` tensors: the output
/// phases (row, column parity) of a 2× image, interleaved.
pub fn interleave2x_nhwc(p: [&Tensor; 4], k: Kernels) -> CResult<Tensor> {
    let (n, h, w, c) = p[0].dims4()?;
    for t in &p[1..] {
        if t.dims() != p[0].dims() || t.dtype() != p[0].dtype() {
            candle_core::bail!(
                "interleave: phases {:?} {:?} and {:?} {:?} differ",
                p[0].dims(),
                p[0].dtype(),
                t.dims(),
                t.dtype()
            );
        }
    }
    let supported = p
        .iter()
        .all(|t| layout_ok(t, c) && t.device().same_device(p[0].device()));
    if k.use_fused(supported, "phase interleaving")? {
        return cuda::interleave2x(p);
    }
    let rows = [
        Tensor::stack(&[p[0], p[1]], 3)?,
        Tensor::stack(&[p[2], p[3]], 3)?,
    ];
    Tensor::stack(&rows, 2)?.reshape((n, 2 * h, 2 * w, c))
}

#[cfg(not(feature = "cuda"))]
mod cuda {
    use super::CResult;
    use candle_core::Tensor;
    // Never reached: `layout_ok` is false without the `cuda` feature.
    pub fn group_norm(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: usize,
        _: f32,
        _: bool,
    ) -> CResult<Tensor> {
        candle_core::bail!("mold's group norm kernel needs a CUDA build")
    }
    pub fn group_stats(_: &Tensor, _: usize) -> CResult<Tensor> {
        candle_core::bail!("mold's group norm kernel needs a CUDA build")
    }
    pub fn group_norm_apply(_: &Tensor, _: &Tensor, _: bool) -> CResult<Tensor> {
        candle_core::bail!("mold's group norm kernel needs a CUDA build")
    }
    pub fn merge_ab(_: &Tensor, _: &Tensor, _: &Tensor, _: f32) -> CResult<Tensor> {
        candle_core::bail!("mold's group norm kernel needs a CUDA build")
    }
    pub fn upsample2x(_: &Tensor) -> CResult<Tensor> {
        candle_core::bail!("mold's up-sampling kernel needs a CUDA build")
    }
    pub fn rms_channels(_: &Tensor, _: &Tensor, _: f32, _: bool) -> CResult<Tensor> {
        candle_core::bail!("mold's RMS norm kernel needs a CUDA build")
    }
    pub fn interleave2x(_: [&Tensor; 4]) -> CResult<Tensor> {
        candle_core::bail!("mold's interleaving kernel needs a CUDA build")
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::CResult;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{
        CudaSlice, CudaView, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda::{CudaDType, CudaDevice, CudaStorage, WrapErr};
    use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Shape, Tensor};
    use half::{bf16, f16};

    const FATBIN: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/groupnorm.fatbin"));
    const MODULE: &str = "mold_groupnorm";
    const THREADS: u32 = 256;
    /// At most this many statistics blocks per image (a few per SM on H100/H200).
    const MAX_BLOCKS: usize = 512;
    /// Most blocks of the grid-stride passes: enough for one vector per thread on any
    /// decoder size (each thread's single load in flight; a grid of 16 blocks per SM looping
    /// over the vectors ran the normalisation at 55% of the memory bandwidth on an H100).
    const MAX_GRID: usize = 1 << 20;

    fn func(
        dev: &CudaDevice,
        name: &str,
        dt: DType,
    ) -> CResult<candle_core::cuda::cudarc::driver::CudaFunction> {
        let suffix = match dt {
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            dt => candle_core::bail!("mold group norm: unsupported dtype {dt:?}"),
        };
        Ok(dev
            .get_or_load_custom_fatbin(&format!("{name}_{suffix}"), MODULE, FATBIN)?
            .into_cuda_function())
    }

    fn view<'a, T: CudaDType>(s: &'a CudaStorage, l: &Layout) -> CResult<CudaView<'a, T>> {
        Ok(s.as_cuda_slice::<T>()?.slice(l.start_offset()..))
    }

    fn grid_stride(vecs: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (
                vecs.div_ceil(THREADS as usize).clamp(1, MAX_GRID) as u32,
                1,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    struct GroupNorm {
        groups: usize,
        eps: f32,
        silu: bool,
    }

    /// Launches `mold_gn_partial` over `x` `(n, hw, c)`: per (image, block, channel)
    /// statistics, and the number of blocks per image.
    fn partial<T: CudaDType + DeviceRepr>(
        dev: &CudaDevice,
        xv: &CudaView<'_, T>,
        dt: DType,
        (n, hw, c): (usize, usize, usize),
    ) -> CResult<(CudaSlice<f32>, usize)> {
        let lanes = THREADS as usize / (c / 8);
        let chunk = hw.div_ceil(MAX_BLOCKS).max(lanes);
        let blocks = hw.div_ceil(chunk).max(1);
        // SAFETY: gn_partial writes every (image, block, channel) entry.
        let part = unsafe { dev.alloc::<f32>(n * blocks * c * 3)? };
        let (hw32, c32, chunk32) = (hw as i32, c as i32, chunk as i32);
        let f = func(dev, "mold_gn_partial", dt)?;
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(xv).arg(&part).arg(&hw32).arg(&c32).arg(&chunk32);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, n as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match the kernel.
        unsafe { a.launch(cfg) }.w()?;
        Ok((part, blocks))
    }

    /// Launches `mold_gn_apply`: `y = silu?(x · a + b)` with `ab` `(n, c, 2)`.
    fn apply<T: CudaDType + DeviceRepr>(
        dev: &CudaDevice,
        xv: &CudaView<'_, T>,
        ab: &CudaView<'_, f32>,
        dt: DType,
        (n, hw, c): (usize, usize, usize),
        silu: bool,
    ) -> CResult<CudaSlice<T>> {
        // SAFETY: gn_apply writes every element.
        let y = unsafe { dev.alloc::<T>(n * hw * c)? };
        let f = func(dev, "mold_gn_apply", dt)?;
        let vecs = hw * c / 8;
        let (vecs32, c32, silu) = (vecs as i32, c as i32, silu as i32);
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(xv).arg(ab).arg(&y).arg(&vecs32).arg(&c32).arg(&silu);
        let cfg = LaunchConfig {
            grid_dim: (grid_stride(vecs).grid_dim.0, n as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: argument order and types match the kernel.
        unsafe { a.launch(cfg) }.w()?;
        Ok(y)
    }

    impl GroupNorm {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let dt = x.dtype();
            let (n, h, w, c) = xl.shape().dims4()?;
            let hw = h * w;
            let (xv, gv, bv) = (view::<T>(x, xl)?, view::<T>(g, gl)?, view::<T>(b, bl)?);
            let (part, blocks) = partial(dev, &xv, dt, (n, hw, c))?;
            // SAFETY: gn_finalize writes every (image, channel) pair.
            let ab = unsafe { dev.alloc::<f32>(n * c * 2)? };
            let stream = dev.cuda_stream();
            let f = func(dev, "mold_gn_finalize", dt)?;
            let (blocks32, c32, groups32) = (blocks as i32, c as i32, self.groups as i32);
            let mut a = stream.launch_builder(&f);
            a.arg(&part)
                .arg(&gv)
                .arg(&bv)
                .arg(&ab)
                .arg(&blocks32)
                .arg(&c32)
                .arg(&groups32)
                .arg(&self.eps);
            let cfg = LaunchConfig {
                grid_dim: (self.groups as u32, n as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            let y = apply(dev, &xv, &ab.slice(..), dt, (n, hw, c), self.silu)?;
            drop((part, ab));
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    /// [`super::group_stats_nhwc`]: partial statistics, then each group's merged.
    struct GroupStats {
        groups: usize,
    }

    impl GroupStats {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let dt = x.dtype();
            let (n, h, w, c) = xl.shape().dims4()?;
            let xv = view::<T>(x, xl)?;
            let (part, blocks) = partial(dev, &xv, dt, (n, h * w, c))?;
            // SAFETY: gn_group_stats writes every (image, group) triple.
            let stats = unsafe { dev.alloc::<f32>(n * self.groups * 3)? };
            let f = func(dev, "mold_gn_group_stats", dt)?;
            let (blocks32, c32, groups32) = (blocks as i32, c as i32, self.groups as i32);
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&part)
                .arg(&stats)
                .arg(&blocks32)
                .arg(&c32)
                .arg(&groups32);
            let cfg = LaunchConfig {
                grid_dim: (self.groups as u32, n as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            drop(part);
            Ok((
                CudaStorage::wrap_cuda_slice(stats, dev.clone()),
                Shape::from((n, self.groups, 3)),
            ))
        }
    }

    impl CustomOp1 for GroupStats {
        fn name(&self) -> &'static str {
            "mold-group-stats"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's group norm kernel runs on CUDA only")
        }
        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl),
                DType::F16 => self.run::<f16>(x, xl),
                dt => candle_core::bail!("mold group norm: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn group_stats(x: &Tensor, groups: usize) -> CResult<Tensor> {
        x.apply_op1_no_bwd(&GroupStats { groups })
    }

    /// [`super::group_norm_coefficients_nhwc`] on the device.
    struct MergeAb {
        eps: f32,
    }

    impl MergeAb {
        #[allow(clippy::too_many_arguments)]
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            st: &CudaStorage,
            sl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &st.device;
            let (k, n, groups, _) = sl.shape().dims4()?;
            let c = gl.shape().dims1()?;
            // SAFETY: gn_merge_ab writes every (image, channel) pair.
            let ab = unsafe { dev.alloc::<f32>(n * c * 2)? };
            let (sv, gv, bv) = (view::<f32>(st, sl)?, view::<T>(g, gl)?, view::<T>(b, bl)?);
            let f = func(dev, "mold_gn_merge_ab", g.dtype())?;
            let (k32, n32, c32, groups32) = (k as i32, n as i32, c as i32, groups as i32);
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&sv)
                .arg(&k32)
                .arg(&gv)
                .arg(&bv)
                .arg(&ab)
                .arg(&n32)
                .arg(&c32)
                .arg(&groups32)
                .arg(&self.eps);
            let cfg = LaunchConfig {
                grid_dim: (groups as u32, n as u32, 1),
                block_dim: (64, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(ab, dev.clone()),
                Shape::from((n, c, 2)),
            ))
        }
    }

    impl CustomOp3 for MergeAb {
        fn name(&self) -> &'static str {
            "mold-group-norm-merge"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's group norm kernel runs on CUDA only")
        }
        fn cuda_fwd(
            &self,
            st: &CudaStorage,
            sl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match g.dtype() {
                DType::BF16 => self.run::<bf16>(st, sl, g, gl, b, bl),
                DType::F16 => self.run::<f16>(st, sl, g, gl, b, bl),
                dt => candle_core::bail!("mold group norm: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn merge_ab(stats: &Tensor, gamma: &Tensor, beta: &Tensor, eps: f32) -> CResult<Tensor> {
        stats.apply_op3_no_bwd(gamma, beta, &MergeAb { eps })
    }

    /// [`super::group_norm_apply_nhwc`] with the coefficients already on the device.
    struct ApplyAb {
        silu: bool,
    }

    impl ApplyAb {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            ab: &CudaStorage,
            abl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let (n, h, w, c) = xl.shape().dims4()?;
            let xv = view::<T>(x, xl)?;
            let abv = view::<f32>(ab, abl)?;
            let y = apply(dev, &xv, &abv, x.dtype(), (n, h * w, c), self.silu)?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    impl CustomOp2 for ApplyAb {
        fn name(&self) -> &'static str {
            "mold-group-norm-apply"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's group norm kernel runs on CUDA only")
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            ab: &CudaStorage,
            abl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, ab, abl),
                DType::F16 => self.run::<f16>(x, xl, ab, abl),
                dt => candle_core::bail!("mold group norm: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn group_norm_apply(x: &Tensor, ab: &Tensor, silu: bool) -> CResult<Tensor> {
        x.apply_op2_no_bwd(ab, &ApplyAb { silu })
    }

    impl CustomOp3 for GroupNorm {
        fn name(&self) -> &'static str {
            "mold-group-norm"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's group norm kernel runs on CUDA only")
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
            b: &CudaStorage,
            bl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, g, gl, b, bl),
                DType::F16 => self.run::<f16>(x, xl, g, gl, b, bl),
                dt => candle_core::bail!("mold group norm: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn group_norm(
        x: &Tensor,
        gamma: &Tensor,
        beta: &Tensor,
        groups: usize,
        eps: f32,
        silu: bool,
    ) -> CResult<Tensor> {
        x.apply_op3_no_bwd(gamma, beta, &GroupNorm { groups, eps, silu })
    }

    struct Upsample2x;

    impl Upsample2x {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let (n, h, w, c) = xl.shape().dims4()?;
            // SAFETY: every output element is written.
            let y = unsafe { dev.alloc::<T>(n * 4 * h * w * c)? };
            let xv = view::<T>(x, xl)?;
            let f = func(dev, "mold_upsample2x", x.dtype())?;
            let vecs = (n * h * w * c / 8) as i64;
            let (c32, h32, w32) = (c as i32, h as i32, w as i32);
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv).arg(&y).arg(&vecs).arg(&c32).arg(&h32).arg(&w32);
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(grid_stride(vecs as usize)) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                Shape::from((n, 2 * h, 2 * w, c)),
            ))
        }
    }

    impl CustomOp1 for Upsample2x {
        fn name(&self) -> &'static str {
            "mold-upsample2x"
        }
        fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's up-sampling kernel runs on CUDA only")
        }
        fn cuda_fwd(&self, x: &CudaStorage, xl: &Layout) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl),
                DType::F16 => self.run::<f16>(x, xl),
                dt => candle_core::bail!("mold up-sampling: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn upsample2x(x: &Tensor) -> CResult<Tensor> {
        x.apply_op1_no_bwd(&Upsample2x)
    }

    struct RmsChannels {
        eps: f32,
        silu: bool,
    }

    impl RmsChannels {
        fn run<T: CudaDType + DeviceRepr>(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            let dev = &x.device;
            let c = *xl.shape().dims().last().unwrap_or(&1);
            let rows = xl.shape().elem_count() / c.max(1);
            // SAFETY: every output element is written.
            let y = unsafe { dev.alloc::<T>(rows * c)? };
            let xv = view::<T>(x, xl)?;
            let gv = view::<T>(g, gl)?;
            let f = func(dev, "mold_rms_rows", x.dtype())?;
            let (rows64, c32, silu) = (rows as i64, c as i32, i32::from(self.silu));
            let stream = dev.cuda_stream();
            let mut a = stream.launch_builder(&f);
            a.arg(&xv)
                .arg(&gv)
                .arg(&y)
                .arg(&rows64)
                .arg(&c32)
                .arg(&self.eps)
                .arg(&silu);
            // A warp per row: 8 rows a block of 256 threads.
            let cfg = LaunchConfig {
                grid_dim: (rows.div_ceil(8).clamp(1, MAX_GRID) as u32, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: argument order and types match the kernel.
            unsafe { a.launch(cfg) }.w()?;
            Ok((
                CudaStorage::wrap_cuda_slice(y, dev.clone()),
                xl.shape().clone(),
            ))
        }
    }

    impl CustomOp2 for RmsChannels {
        fn name(&self) -> &'static str {
            "mold-rms-channels"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> CResult<(CpuStorage, Shape)> {
            candle_core::bail!("mold's RMS norm kernel runs on CUDA only")
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            g: &CudaStorage,
            gl: &Layout,
        ) -> CResult<(CudaStorage, Shape)> {
            match x.dtype() {
                DType::BF16 => self.run::<bf16>(x, xl, g, gl),
                DType::F16 => self.run::<f16>(x, xl, g, gl),
                dt => candle_core::bail!("mold RMS norm: unsupported dtype {dt:?}"),
            }
        }
    }

    pub fn rms_channels(x: &Tensor, gamma: &Tensor, eps: f32, silu: bool) -> CResult<Tensor> {
        x.apply_op2_no_bwd(gamma, &RmsChannels { eps, silu })
    }

    fn storage_view<'a, T: CudaDType>(
        s: &'a candle_core::Storage,
        l: &Layout,
    ) -> CResult<CudaView<'a, T>> {
        let candle_core::Storage::Cuda(c) = s else {
            candle_core::bail!("mold interleave: not a CUDA tensor");
        };
        view::<T>(c, l)
    }

    fn interleave_run<T: CudaDType + DeviceRepr>(p: [&Tensor; 4]) -> CResult<Tensor> {
        let candle_core::Device::Cuda(dev) = p[0].device() else {
            candle_core::bail!("mold interleave: not a CUDA tensor");
        };
        let (n, h, w, c) = p[0].dims4()?;
        let guards: Vec<_> = p.iter().map(|t| t.storage_and_layout()).collect();
        let views = guards
            .iter()
            .map(|(s, l)| storage_view::<T>(s, l))
            .collect::<CResult<Vec<_>>>()?;
        // SAFETY: every output element is written.
        let y = unsafe { dev.alloc::<T>(n * 4 * h * w * c)? };
        let f = func(dev, "mold_interleave2x", p[0].dtype())?;
        let vecs = (n * h * w * c / 8) as i64;
        let (c32, h32, w32) = (c as i32, h as i32, w as i32);
        let stream = dev.cuda_stream();
        let mut a = stream.launch_builder(&f);
        a.arg(&views[0])
            .arg(&views[1])
            .arg(&views[2])
            .arg(&views[3])
            .arg(&y)
            .arg(&vecs)
            .arg(&c32)
            .arg(&h32)
            .arg(&w32);
        // SAFETY: argument order and types match the kernel.
        unsafe { a.launch(grid_stride(vecs as usize)) }.w()?;
        drop(views);
        drop(guards);
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(y, dev.clone())),
            (n, 2 * h, 2 * w, c),
            candle_core::op::BackpropOp::none(),
            false,
        ))
    }

    pub fn interleave2x(p: [&Tensor; 4]) -> CResult<Tensor> {
        match p[0].dtype() {
            DType::BF16 => interleave_run::<bf16>(p),
            DType::F16 => interleave_run::<f16>(p),
            dt => candle_core::bail!("mold interleave: unsupported dtype {dt:?}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Module};

    fn rand(shape: &[usize], seed: u64) -> Tensor {
        // A deterministic, non-centred input (an offset mean stresses the variance).
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                let x = ((i as u64 + 1) * 0x9E37_79B9 + seed * 7919) % 10_007;
                3.0 + x as f32 / 10_007.0 * 2.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        (d.to_scalar::<f32>().unwrap()) / m.to_scalar::<f32>().unwrap()
    }

    /// Statistics taken on row bands, merged, then applied band by band: the whole tensor's
    /// group norm (how a decoder split over devices normalises).
    #[test]
    fn band_statistics_merged_equal_the_whole_group_norm() {
        let (n, h, w, c, groups) = (2, 7, 5, 64, 32);
        let x = rand(&[n, h, w, c], 4);
        let gamma = rand(&[c], 5);
        let beta = (rand(&[c], 6) - 3.0).unwrap();
        let want = group_norm_candle(&x, &gamma, &beta, groups, 1e-6, true).unwrap();
        let gv = gamma.to_vec1::<f32>().unwrap();
        let bv = beta.to_vec1::<f32>().unwrap();
        for cuts in [vec![0, 7], vec![0, 3, 7], vec![0, 1, 2, 5, 7]] {
            let bands: Vec<Tensor> = cuts
                .windows(2)
                .map(|r| x.narrow(1, r[0], r[1] - r[0]).unwrap())
                .collect();
            let parts: Vec<Vec<f32>> = bands
                .iter()
                .map(|b| {
                    let s = group_stats_nhwc(b, groups, Kernels::Auto).unwrap();
                    assert_eq!(s.dims(), [n, groups, 3]);
                    s.flatten_all().unwrap().to_vec1().unwrap()
                })
                .collect();
            let merged = merge_group_stats(&parts).unwrap();
            let ab = norm_coefficients(&merged, &gv, &bv, groups, 1e-6).unwrap();
            let ab = Tensor::from_vec(ab, (n, c, 2), &Device::Cpu).unwrap();
            // The same coefficients from the bands' statistics stacked on one device.
            let stacked: Vec<Tensor> = bands
                .iter()
                .map(|b| group_stats_nhwc(b, groups, Kernels::Auto).unwrap())
                .collect();
            let stacked = Tensor::stack(&stacked, 0).unwrap();
            let ab2 =
                group_norm_coefficients_nhwc(&stacked, &gamma, &beta, 1e-6, Kernels::Auto).unwrap();
            assert_eq!(max_rel(&ab2, &ab), 0.0);
            let got: Vec<Tensor> = bands
                .iter()
                .map(|b| group_norm_apply_nhwc(b, &ab, true, Kernels::Auto).unwrap())
                .collect();
            let got = Tensor::cat(&got, 1).unwrap();
            let e = max_rel(&got, &want);
            assert!(e < 1e-5, "bands {cuts:?}: {e}");
        }
        // Shapes that cannot merge are refused, not mixed.
        assert!(merge_group_stats(&[vec![0.0; 6], vec![0.0; 3]]).is_err());
        assert!(merge_group_stats(&[]).is_err());
        assert!(norm_coefficients(&[1.0, 0.0, 0.0], &gv, &bv[..3], groups, 1e-6).is_err());
        let bad = Tensor::zeros((2, n, groups, 2), DType::F32, &Device::Cpu).unwrap();
        assert!(group_norm_coefficients_nhwc(&bad, &gamma, &beta, 1e-6, Kernels::Auto).is_err());
    }

    /// The channels-last group norm equals candle-nn's GroupNorm on the NCHW tensor.
    #[test]
    fn group_norm_matches_candle_nn() {
        let (n, c, h, w, groups) = (2, 64, 5, 7, 32);
        let x = rand(&[n, c, h, w], 1);
        let gamma = rand(&[c], 2);
        let beta = (rand(&[c], 3) - 3.0).unwrap();
        let reference = candle_nn::GroupNorm::new(gamma.clone(), beta.clone(), c, groups, 1e-6)
            .unwrap()
            .forward(&x)
            .unwrap();
        let x_nhwc = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
        for silu in [false, true] {
            let y = group_norm_nhwc(&x_nhwc, &gamma, &beta, groups, 1e-6, silu, Kernels::Auto)
                .unwrap()
                .permute((0, 3, 1, 2))
                .unwrap();
            let want = if silu {
                reference.silu().unwrap()
            } else {
                reference.clone()
            };
            let e = max_rel(&y, &want);
            assert!(e < 1e-5, "silu {silu}: max relative error {e}");
        }
    }

    #[test]
    fn group_norm_refuses_bad_shapes() {
        let x = rand(&[1, 2, 2, 48], 0);
        let p = rand(&[48], 0);
        let e = group_norm_nhwc(&x, &p, &p, 32, 1e-6, false, Kernels::Auto).unwrap_err();
        assert!(e.to_string().contains("32 groups do not divide 48"), "{e}");
        let q = rand(&[47], 0);
        let e = group_norm_nhwc(&x, &q, &p, 16, 1e-6, false, Kernels::Auto).unwrap_err();
        assert!(e.to_string().contains("gamma"), "{e}");
    }

    /// Interleaving four phases puts phase (a, b) at rows 2i + a, columns 2j + b.
    #[test]
    fn interleave_places_each_phase() {
        let p: Vec<Tensor> = (0..4).map(|i| rand(&[2, 3, 4, 8], i)).collect();
        let y = interleave2x_nhwc([&p[0], &p[1], &p[2], &p[3]], Kernels::Auto).unwrap();
        assert_eq!(y.dims(), [2, 6, 8, 8]);
        for a in 0..2 {
            for b in 0..2 {
                let got = y
                    .reshape((2, 3, 2, 4, 2, 8))
                    .unwrap()
                    .narrow(2, a, 1)
                    .unwrap()
                    .narrow(4, b, 1)
                    .unwrap()
                    .reshape((2, 3, 4, 8))
                    .unwrap();
                assert_eq!(max_rel(&got, &p[2 * a + b]), 0.0, "phase ({a}, {b})");
            }
        }
    }

    /// Up-sampling equals candle's NCHW nearest up-sampling.
    #[test]
    fn upsample_matches_candle() {
        let x = rand(&[2, 8, 3, 4], 5);
        let want = x.upsample_nearest2d(6, 8).unwrap();
        let got = upsample2x_nhwc(&x.permute((0, 2, 3, 1)).unwrap(), Kernels::Auto)
            .unwrap()
            .permute((0, 3, 1, 2))
            .unwrap();
        assert_eq!(max_rel(&got, &want), 0.0);
    }
}
