//! The request bodies the server takes and their checks: every refusal is one line
//! naming the field and what to send instead. Unknown fields are refused by name.

use crate::options::ServeOptions;
use mold_models::ModelSpec;
use mold_pipeline::Request;
use mold_plan::Plan;
use serde::Deserialize;

/// `POST /v1/images/generations`: OpenAI's image request (`prompt`, `n`, `size`,
/// `response_format`, `model`, `user`), plus mold's `seed` and `steps`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImagesRequest {
    pub prompt: String,
    pub n: Option<u32>,
    /// `WIDTHxHEIGHT`, e.g. `1024x1024`.
    pub size: Option<String>,
    /// Only `b64_json`: images come back inline.
    pub response_format: Option<String>,
    pub model: Option<String>,
    /// Accepted and ignored (OpenAI's end-user id).
    pub user: Option<String>,
    /// The first image's seed; image `i` gets `seed + i` (default 0).
    pub seed: Option<u64>,
    pub steps: Option<u32>,
}

/// `POST /v1/generate` and `/v1/generate/stream`: every `mold exec --prompt` setting.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    pub prompt: String,
    pub seed: Option<u64>,
    pub steps: Option<u32>,
    pub guidance: Option<f64>,
    pub width: Option<u32>,
    pub height: Option<u32>,
}

/// A refused request: the HTTP status and one line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

fn bad(message: String) -> Refusal {
    Refusal {
        status: 400,
        message,
    }
}

/// Parses a JSON body into `T`, naming the field at fault.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, Refusal> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(bad(
            "body: empty; send a JSON object, e.g. {\"prompt\": \"a red fox in snow\"}".into(),
        ));
    }
    let de = &mut serde_json::Deserializer::from_slice(body);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        if path == "." || msg.starts_with("unknown field") || msg.starts_with("missing field") {
            bad(format!("body: {msg}"))
        } else {
            bad(format!("{path}: {msg}"))
        }
    })
}

/// What a checked request becomes: one pipeline request per image.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    pub requests: Vec<Request>,
}

/// Whether a request could ask for `width`×`height` from `plan` (what `--warm-up-sizes`
/// is checked against before anything loads): the refusal's message where not.
pub(crate) fn size_refusal(
    opts: &ServeOptions,
    model: &ModelSpec,
    plan: &Plan,
    (width, height): (u32, u32),
) -> Option<String> {
    Common { opts, model, plan }
        .size(width, height, "size")
        .err()
        .map(|r| r.message)
}

/// The checks both endpoints share; `plan` gives the defaults.
struct Common<'a> {
    opts: &'a ServeOptions,
    model: &'a ModelSpec,
    plan: &'a Plan,
}

impl Common<'_> {
    fn prompt(&self, p: &str) -> Result<String, Refusal> {
        if p.trim().is_empty() {
            return Err(bad(
                "prompt: empty; give the text of the image to make".into()
            ));
        }
        let n = p.chars().count();
        if n > self.opts.max_prompt_chars {
            return Err(bad(format!(
                "prompt: {n} characters, more than this server takes ({}); shorten it",
                self.opts.max_prompt_chars
            )));
        }
        Ok(p.to_string())
    }

    fn steps(&self, s: Option<u32>) -> Result<u32, Refusal> {
        let s = s.unwrap_or(self.plan.workload.steps);
        if s == 0 || s > self.opts.max_steps {
            return Err(bad(format!(
                "steps: {s}; give 1 to {} denoising steps",
                self.opts.max_steps
            )));
        }
        Ok(s)
    }

    /// The model's range and multiple (named per field, as `mold plan --size` does),
    /// then the size the plan was made for: its memory was priced for that size, and a
    /// larger image could run a device out of memory and fail the others' requests.
    fn size(&self, width: u32, height: u32, field: &str) -> Result<(), Refusal> {
        let mut w = self.plan.workload.clone();
        w.width = width;
        w.height = height;
        let named = |which: &str, rest: String| {
            if field == "size" {
                bad(format!("size: {which} {rest}"))
            } else {
                bad(format!("{which}: {rest}"))
            }
        };
        self.model.check_workload(&w).map_err(|e| match e {
            mold_models::ModelError::Workload { field: f, message } => {
                named(f.trim_start_matches("workload."), message)
            }
            other => bad(format!("{field}: {other}")),
        })?;
        let (pw, ph) = (self.plan.workload.width, self.plan.workload.height);
        for (which, v, limit) in [("width", width, pw), ("height", height, ph)] {
            if v > limit {
                return Err(named(
                    which,
                    format!(
                        "{v} is more than the {limit} this server's plan was sized for ({pw}x{ph}); ask for at most {pw}x{ph}, or serve a plan made with `mold plan --size {width}x{height}`"
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Checks an OpenAI-style request: `n` images of `size`, seeds `seed`, `seed + 1`, ….
pub fn check_images(
    r: &ImagesRequest,
    opts: &ServeOptions,
    model: &ModelSpec,
    plan: &Plan,
) -> Result<Checked, Refusal> {
    let c = Common { opts, model, plan };
    let prompt = c.prompt(&r.prompt)?;
    let n = r.n.unwrap_or(1);
    if n == 0 || n > opts.max_images {
        return Err(bad(format!(
            "n: {n}; ask for 1 to {} images per request",
            opts.max_images
        )));
    }
    let queue = opts.queue.max(1);
    if n as usize > queue {
        return Err(bad(format!(
            "n: {n} images, more than this server's queue holds ({queue}); ask for at most {queue} per request"
        )));
    }
    if let Some(f) = &r.response_format {
        if f != "b64_json" {
            return Err(bad(format!(
                "response_format: `{f}`; this server returns images inline: use b64_json"
            )));
        }
    }
    if let Some(m) = &r.model {
        if m != &plan.model.id {
            return Err(bad(format!(
                "model: `{m}`; this server runs `{}` (leave model out, or send it)",
                plan.model.id
            )));
        }
    }
    let (width, height) = match &r.size {
        None => (plan.workload.width, plan.workload.height),
        Some(s) => {
            let parsed = s
                .split_once(['x', 'X'])
                .and_then(|(w, h)| Some((w.trim().parse().ok()?, h.trim().parse().ok()?)));
            match parsed {
                Some(wh) => wh,
                None => {
                    return Err(bad(format!(
                        "size: `{s}`; write WIDTHxHEIGHT, e.g. {}x{}",
                        plan.workload.width, plan.workload.height
                    )))
                }
            }
        }
    };
    c.size(width, height, "size")?;
    let steps = c.steps(r.steps)?;
    let seed = r.seed.unwrap_or(0);
    let requests = (0..n as u64)
        .map(|i| Request {
            prompt: prompt.clone(),
            seed: seed.wrapping_add(i),
            steps,
            guidance: None,
            width,
            height,
            latents: None,
            save_io: None,
            // Only the progress stream shows digests (`/v1/generate/stream` turns them
            // back on): a plain request takes none.
            no_digests: true,
        })
        .collect();
    Ok(Checked { requests })
}

/// Checks a native request.
pub fn check_generate(
    r: &GenerateRequest,
    opts: &ServeOptions,
    model: &ModelSpec,
    plan: &Plan,
) -> Result<Checked, Refusal> {
    let c = Common { opts, model, plan };
    let prompt = c.prompt(&r.prompt)?;
    let width = r.width.unwrap_or(plan.workload.width);
    let height = r.height.unwrap_or(plan.workload.height);
    c.size(width, height, "width")?;
    let steps = c.steps(r.steps)?;
    if let Some(g) = r.guidance {
        if !g.is_finite() || g < 0.0 {
            return Err(bad(format!(
                "guidance: {g}; give a finite number >= 0 (e.g. 3.5)"
            )));
        }
    }
    Ok(Checked {
        requests: vec![Request {
            prompt,
            seed: r.seed.unwrap_or(0),
            steps,
            guidance: r.guidance,
            width,
            height,
            latents: None,
            save_io: None,
            no_digests: true,
        }],
    })
}
