//! PNG output with the prompt and settings as tEXt chunks.

use crate::error::{PipelineError, Result};
use std::path::Path;

/// An 8-bit RGB image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RgbImage {
    pub width: u32,
    pub height: u32,
    /// Row-major, interleaved R, G, B.
    pub data: Vec<u8>,
}

/// Encodes `img` as a PNG with one tEXt chunk per `(keyword, text)`. tEXt is Latin-1:
/// characters outside it are written as `?` (PNG readers show the rest as is).
pub fn encode_png(img: &RgbImage, text: &[(String, String)]) -> Result<Vec<u8>> {
    encode_png_with(img, text, PNG_COMPRESSION)
}

/// How [`encode_png`] compresses: fdeflate's fast mode. On a 1024² image it takes a few ms
/// where the default (`Balanced`) takes over 100 ms of a request, for files about a tenth
/// larger (`cargo run --release -p mold-pipeline --example image_bench`, BENCHMARKS.md).
pub const PNG_COMPRESSION: png::Compression = png::Compression::Fast;

/// [`encode_png`] at the compression level `compression`.
pub fn encode_png_with(
    img: &RgbImage,
    text: &[(String, String)],
    compression: png::Compression,
) -> Result<Vec<u8>> {
    let err = |e: png::EncodingError| PipelineError::Png {
        path: "<memory>".into(),
        message: e.to_string(),
    };
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, img.width, img.height);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        enc.set_compression(compression);
        for (k, v) in text {
            let latin1: String = v
                .chars()
                .map(|c| if (c as u32) < 256 { c } else { '?' })
                .collect();
            enc.add_text_chunk(k.clone(), latin1).map_err(err)?;
        }
        let mut w = enc.write_header().map_err(err)?;
        w.write_image_data(&img.data).map_err(err)?;
        w.finish().map_err(err)?;
    }
    Ok(out)
}

/// The tEXt keyword of the stamp [`write_png`] adds ([`mold_files::Stamp::Png`]): a PNG
/// mold wrote and nobody changed since is one `mold exec --out` may replace.
pub const STAMP_KEYWORD: &str = "mold";

/// Writes `img` to `path` as a PNG (see [`encode_png`]) with a last tEXt chunk
/// [`STAMP_KEYWORD`] holding its stamp, atomically: through a temporary file renamed over
/// `path` (never through a symlink there, never half a file). Whether `path` may be
/// replaced is the caller's to check first ([`mold_files::Dest::check`]).
pub fn write_png(path: &Path, img: &RgbImage, text: &[(String, String)]) -> Result<()> {
    let mut text = text.to_vec();
    text.push((STAMP_KEYWORD.into(), mold_files::PLACEHOLDER.into()));
    let bytes = encode_png(img, &text).map_err(|e| match e {
        PipelineError::Png { message, .. } => PipelineError::Png {
            path: path.display().to_string(),
            message,
        },
        e => e,
    })?;
    let bytes =
        mold_files::stamp(mold_files::Stamp::Png, &bytes).ok_or_else(|| PipelineError::Png {
            path: path.display().to_string(),
            message: "the encoder dropped the stamp's tEXt chunk".into(),
        })?;
    mold_files::write_bytes(path, &bytes).map_err(PipelineError::io(path))
}

/// Reads a PNG back: the image (8-bit RGB only) and its tEXt chunks. For tests and tools.
pub fn read_png(path: &Path) -> Result<(RgbImage, Vec<(String, String)>)> {
    let bad = |m: String| PipelineError::Png {
        path: path.display().to_string(),
        message: m,
    };
    let f = std::fs::File::open(path).map_err(PipelineError::io(path))?;
    let mut reader = png::Decoder::new(std::io::BufReader::new(f))
        .read_info()
        .map_err(|e| bad(e.to_string()))?;
    let mut buf = vec![0; reader.output_buffer_size().unwrap_or(0)];
    let info = reader
        .next_frame(&mut buf)
        .map_err(|e| bad(e.to_string()))?;
    if info.color_type != png::ColorType::Rgb || info.bit_depth != png::BitDepth::Eight {
        return Err(bad("not an 8-bit RGB PNG".into()));
    }
    buf.truncate(info.buffer_size());
    let text = reader
        .info()
        .uncompressed_latin1_text
        .iter()
        .map(|c| (c.keyword.clone(), c.text.clone()))
        .collect();
    Ok((
        RgbImage {
            width: info.width,
            height: info.height,
            data: buf,
        },
        text,
    ))
}

/// One decoded image `(3, h, w)` → `(width, height, bytes)`, interleaved RGB, each value
/// made a byte by `byte` (the family's rule: BFL truncates, diffusers rounds). Another
/// channel count is refused, naming the VAE.
pub(crate) fn rgb8_with(
    img: &candle_core::Tensor,
    byte: impl Fn(f32) -> u8,
) -> Result<(u32, u32, Vec<u8>)> {
    let (c, h, w) = img.dims3()?;
    if c != 3 {
        return Err(PipelineError::Component {
            component: "vae".into(),
            message: format!("decoded {c} channels, expected 3 (RGB)"),
        });
    }
    // Widened where it is (a GPU does it at once), copied as it lies (channel planes), then
    // interleaved here: a strided copy on the host would cost more than the rest.
    let chw = img
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_device(&candle_core::Device::Cpu)?
        .to_vec1::<f32>()?;
    let plane = h * w;
    let (r, rest) = chw.split_at(plane);
    let (g, b) = rest.split_at(plane);
    let mut out = Vec::with_capacity(3 * plane);
    for ((r, g), b) in r.iter().zip(g).zip(b) {
        out.extend_from_slice(&[byte(*r), byte(*g), byte(*b)]);
    }
    Ok((w as u32, h as u32, out))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Channel planes in, rows of interleaved R, G, B out, pixel by pixel in row order.
    #[test]
    fn rgb_bytes_interleave_the_channel_planes() {
        // 3 channels × 2 rows × 3 columns: channel c, row y, column x holds 100c + 10y + x.
        let v: Vec<f32> = (0..3)
            .flat_map(|c| {
                (0..2).flat_map(move |y| (0..3).map(move |x| (100 * c + 10 * y + x) as f32))
            })
            .collect();
        let t = candle_core::Tensor::from_vec(v, (3, 2, 3), &candle_core::Device::Cpu).unwrap();
        let (w, h, data) = rgb8_with(&t, |v| v as u8).unwrap();
        assert_eq!((w, h), (3, 2));
        let want: Vec<u8> = (0..2)
            .flat_map(|y| {
                (0..3).flat_map(move |x| (0..3).map(move |c| (100 * c + 10 * y + x) as u8))
            })
            .collect();
        assert_eq!(data, want);
        // A strided (transposed) tensor reads as its values, not its storage.
        let tt = t.transpose(1, 2).unwrap();
        let (w, h, data) = rgb8_with(&tt, |v| v as u8).unwrap();
        assert_eq!((w, h), (2, 3));
        assert_eq!(data[..6], [0, 100, 200, 10, 110, 210]);
    }

    /// Every compression level writes a PNG that reads back as the same pixels.
    #[test]
    fn each_compression_reads_back_the_same_pixels() {
        let img = RgbImage {
            width: 4,
            height: 3,
            data: (0..36).map(|i| (i * 7) as u8).collect(),
        };
        for c in [
            png::Compression::Fast,
            png::Compression::Balanced,
            png::Compression::NoCompression,
        ] {
            let bytes = encode_png_with(&img, &[], c).unwrap();
            let d = png::Decoder::new(std::io::Cursor::new(bytes));
            let mut r = d.read_info().unwrap();
            let mut buf = vec![0; r.output_buffer_size().unwrap()];
            let info = r.next_frame(&mut buf).unwrap();
            assert_eq!(&buf[..info.buffer_size()], &img.data[..], "{c:?}");
        }
    }

    #[test]
    fn text_chunks_round_trip() {
        let img = RgbImage {
            width: 2,
            height: 1,
            data: vec![255, 0, 0, 0, 0, 255],
        };
        let d = std::env::temp_dir().join(format!("mold-pipeline-png-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let p = d.join("x.png");
        let text = vec![("prompt".to_string(), "a red fox in snow".to_string())];
        write_png(&p, &img, &text).unwrap();
        // read_png checks every chunk's CRC: the stamp's chunk was rewritten correctly.
        let (back, t) = read_png(&p).unwrap();
        assert_eq!(back, img);
        assert_eq!(t[..1], text[..]);
        assert_eq!(t[1].0, STAMP_KEYWORD);
        let bytes = std::fs::read(&p).unwrap();
        assert!(mold_files::is_unchanged(mold_files::Stamp::Png, &bytes));
        // Another image written over it: still mold's, unchanged.
        write_png(&p, &img, &[]).unwrap();
        let mut bytes = std::fs::read(&p).unwrap();
        assert!(mold_files::is_unchanged(mold_files::Stamp::Png, &bytes));
        // A pixel changed (in the compressed data): no longer.
        let i = bytes.len() - 20;
        bytes[i] ^= 1;
        assert!(!mold_files::is_unchanged(mold_files::Stamp::Png, &bytes));
        std::fs::remove_dir_all(&d).unwrap();
    }
}
