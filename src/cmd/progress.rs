//! How `mold exec` and `mold testdata` report as they go ([`Reporter`]):
//!
//! - on a terminal (stdout and stderr both): progress bars on stderr (a spinner with the
//!   elapsed time while weights load, a bar over denoising steps with seconds per step,
//!   a bar of bytes per file while test data is written); bars vanish when done, and the
//!   other lines are printed as when not on a terminal;
//! - otherwise: plain lines, one per event (what mold always printed);
//! - `--quiet`: errors, warnings and the result line only;
//! - `--json`: one JSON object per line on stdout, one per event (schema in the README,
//!   "Progress and JSON output"); errors and warnings stay plain text on stderr.

use indicatif::{ProgressBar, ProgressFinish, ProgressStyle};
use mold_pipeline::Progress;
use serde_json::{json, Value};
use std::cell::{Cell, RefCell};
use std::io::IsTerminal;
use std::rc::Rc;
use std::time::Duration;

/// `--quiet` and `--json`, shared by the commands that report progress.
#[derive(clap::Args, Debug, Clone, Copy, Default)]
pub struct OutputArgs {
    /// Print only errors, warnings and the result line (no progress).
    #[arg(long, conflicts_with = "json")]
    pub quiet: bool,
    /// Print one JSON object per line on stdout, one per event, for programs (README:
    /// "Progress and JSON output").
    #[arg(long)]
    pub json: bool,
}

/// How a command reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Bars,
    Plain,
    Quiet,
    Json,
}

impl Mode {
    /// `--json`, else `--quiet`, else bars when stdout and stderr are both terminals,
    /// else plain lines.
    pub fn choose(a: OutputArgs, stdout_tty: bool, stderr_tty: bool) -> Mode {
        if a.json {
            Mode::Json
        } else if a.quiet {
            Mode::Quiet
        } else if stdout_tty && stderr_tty {
            Mode::Bars
        } else {
            Mode::Plain
        }
    }
}

/// Prints a plain line through a [`Reporter`] (like `println!`).
macro_rules! say {
    ($r:expr, $($t:tt)*) => {
        $r.line(format_args!($($t)*))
    };
}
pub(crate) use say;

/// What a command prints, in its [`Mode`]. Cheap to clone (clones share the bar).
#[derive(Clone)]
pub struct Reporter {
    mode: Mode,
    /// The one bar or spinner on screen (bars follow each other, never overlap).
    bar: Rc<RefCell<Option<ProgressBar>>>,
    /// Seconds of the steps so far, for seconds per step.
    step_s: Rc<Cell<f64>>,
}

impl Reporter {
    pub fn new(a: OutputArgs) -> Reporter {
        Reporter::with_mode(Mode::choose(
            a,
            std::io::stdout().is_terminal(),
            std::io::stderr().is_terminal(),
        ))
    }

    pub fn with_mode(mode: Mode) -> Reporter {
        Reporter {
            mode,
            bar: Rc::new(RefCell::new(None)),
            step_s: Rc::new(Cell::new(0.0)),
        }
    }

    /// Runs `f` (which prints) with the bar, if any, out of the way.
    fn printing(&self, f: impl FnOnce()) {
        match self.bar.borrow().as_ref() {
            Some(b) => b.suspend(f),
            None => f(),
        }
    }

    /// A plain line on stdout (use [`say!`]): printed in plain and bar modes.
    pub fn line(&self, args: std::fmt::Arguments) {
        if matches!(self.mode, Mode::Plain | Mode::Bars) {
            self.printing(|| println!("{args}"));
        }
    }

    /// A line that a bar replaces (a step's): printed in plain mode only.
    pub fn plain(&self, args: std::fmt::Arguments) {
        if self.mode == Mode::Plain {
            println!("{args}");
        }
    }

    /// Runs `f` with a bar of bytes for each file of test data it writes (bar mode).
    pub fn observe_writes<R>(&self, f: impl FnOnce() -> R) -> R {
        if self.mode != Mode::Bars {
            return f();
        }
        let r = self.clone();
        let out = mold_exec::random_weights::observe_writes(
            move |p, done, total| r.writing(p, done, total),
            f,
        );
        self.clear();
        out
    }

    /// The command's result: `line` on stdout, except with `--json`, which prints `event`.
    pub fn result(&self, line: std::fmt::Arguments, event: Value) {
        match self.mode {
            Mode::Json => println!("{event}"),
            _ => self.printing(|| println!("{line}")),
        }
    }

    /// One JSON event, printed with `--json` only.
    pub fn event(&self, event: Value) {
        if self.mode == Mode::Json {
            println!("{event}");
        }
    }

    /// Replaces the bar on screen (bar mode only). A bar still on screen when the
    /// command ends (an error) is cleared.
    fn show(&self, bar: ProgressBar) {
        let bar = bar.with_finish(ProgressFinish::AndClear);
        if let Some(old) = self.bar.replace(Some(bar)) {
            old.finish_and_clear();
        }
    }

    /// Takes the bar or spinner off the screen.
    pub fn clear(&self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }

    /// A spinner with the elapsed time, until [`Reporter::clear`] or the next bar (bar
    /// mode only).
    pub fn spin(&self, what: String) {
        if self.mode != Mode::Bars {
            return;
        }
        let b = ProgressBar::new_spinner()
            .with_style(style(SPINNER))
            .with_message(what);
        b.enable_steady_tick(Duration::from_millis(100));
        self.show(b);
    }

    /// Denoising step `index` (from 1) of `steps` took `seconds`: the bar moves (bar
    /// mode only) and vanishes after the last step.
    pub fn step(&self, index: u32, steps: u32, seconds: f64) {
        if self.mode != Mode::Bars {
            return;
        }
        if index <= 1 || self.bar.borrow().is_none() {
            self.step_s.set(0.0);
            let b = ProgressBar::new(u64::from(steps)).with_style(style(STEPS));
            self.show(b);
        }
        self.step_s.set(self.step_s.get() + seconds);
        if let Some(b) = self.bar.borrow().as_ref() {
            b.set_message(format!(
                "{:.3} s/step",
                self.step_s.get() / f64::from(index.max(1))
            ));
            b.set_position(u64::from(index));
        }
        if index >= steps {
            self.clear();
        }
    }

    /// `file` holds `done` of its `total` bytes so far (bar mode only): one bar per
    /// file, gone when the file is complete.
    pub fn writing(&self, file: &std::path::Path, done: u64, total: u64) {
        if self.mode != Mode::Bars {
            return;
        }
        // The whole path tells files apart (the prefix, not shown); the last two parts
        // of it are shown (`t5/model.safetensors`).
        let path = file.display().to_string();
        let same = self
            .bar
            .borrow()
            .as_ref()
            .is_some_and(|b| b.prefix() == path);
        if !same {
            let parts: Vec<_> = file.iter().collect();
            let shown = parts[parts.len().saturating_sub(2)..]
                .iter()
                .map(|p| p.to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let b = ProgressBar::new(total)
                .with_style(style(BYTES))
                .with_prefix(path)
                .with_message(shown);
            self.show(b);
        }
        if let Some(b) = self.bar.borrow().as_ref() {
            b.set_position(done);
        }
        if done >= total {
            self.clear();
        }
    }

    /// One event of the text-to-image pipeline: its line on stderr (plain), a spinner
    /// while a component loads and a bar over the steps (bars), its JSON (`--json`).
    pub fn pipeline(&self, p: &Progress) {
        match self.mode {
            Mode::Plain => eprintln!("{p}"),
            Mode::Quiet => {}
            Mode::Json => println!("{}", progress_event(p)),
            Mode::Bars => match p {
                Progress::Loading { component, devices } => {
                    self.spin(format!("load   {component} on {devices}"))
                }
                Progress::Step {
                    index,
                    steps,
                    seconds,
                    ..
                } => self.step(*index, *steps, *seconds),
                Progress::Loaded { .. } => {
                    self.clear();
                    eprintln!("{p}");
                }
                _ => self.printing(|| eprintln!("{p}")),
            },
        }
    }
}

/// The spinner while something loads.
const SPINNER: &str = "{spinner} {msg} {elapsed}";
/// The bar over denoising steps.
const STEPS: &str = "denoise [{wide_bar}] {pos}/{len} steps, {msg}, ETA {eta}";
/// The bar of a file being written.
const BYTES: &str =
    "{msg} [{wide_bar}] {binary_bytes}/{binary_total_bytes}, {binary_bytes_per_sec}, ETA {eta}";

/// A bar style from a template (a fixed one: the default style stands in should it not
/// parse).
fn style(template: &str) -> ProgressStyle {
    ProgressStyle::with_template(template)
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ")
}

/// A 64-bit digest as the plain lines print it (JSON numbers lose precision above 2^53).
pub fn hex(d: u64) -> String {
    format!("{d:016x}")
}

/// `v` with `key`: `d` in hex, where the run took the digest (a run without digests
/// leaves the key out).
fn with_digest(mut v: Value, key: &str, d: Option<u64>) -> Value {
    if let (Some(d), Some(o)) = (d, v.as_object_mut()) {
        o.insert(key.into(), Value::String(hex(d)));
    }
    v
}

/// The JSON event of one pipeline [`Progress`].
pub fn progress_event(p: &Progress) -> Value {
    match p {
        Progress::Loading { component, devices } => {
            json!({"event": "loading", "component": component, "devices": devices})
        }
        Progress::Loaded {
            component,
            devices,
            seconds,
            weight_bytes,
        } => json!({
            "event": "loaded",
            "component": component,
            "devices": devices,
            "seconds": seconds,
            "weight_bytes": weight_bytes,
        }),
        Progress::Encoded {
            component,
            seconds,
            digest,
        } => with_digest(
            json!({
                "event": "encoded",
                "component": component,
                "seconds": seconds,
            }),
            "digest",
            *digest,
        ),
        Progress::Released { component } => json!({"event": "released", "component": component}),
        Progress::Step {
            index,
            steps,
            t,
            seconds,
            digest,
        } => with_digest(
            json!({
                "event": "step",
                "index": index,
                "steps": steps,
                "t": t,
                "seconds": seconds,
            }),
            "digest",
            *digest,
        ),
        Progress::Decoded {
            devices,
            seconds,
            latents_digest,
            image_digest,
        } => with_digest(
            with_digest(
                json!({
                    "event": "decoded",
                    "devices": devices,
                    "seconds": seconds,
                }),
                "latents_digest",
                *latents_digest,
            ),
            "image_digest",
            *image_digest,
        ),
        Progress::Note(n) => json!({"event": "note", "message": n}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_beats_quiet_beats_a_terminal() {
        let a = |quiet, json| OutputArgs { quiet, json };
        assert_eq!(Mode::choose(a(false, false), true, true), Mode::Bars);
        // Bars only when both streams are terminals: a redirected stdout keeps its lines.
        assert_eq!(Mode::choose(a(false, false), false, true), Mode::Plain);
        assert_eq!(Mode::choose(a(false, false), true, false), Mode::Plain);
        assert_eq!(Mode::choose(a(true, false), true, true), Mode::Quiet);
        assert_eq!(Mode::choose(a(false, true), true, true), Mode::Json);
        assert_eq!(Mode::choose(a(false, true), false, false), Mode::Json);
    }

    #[test]
    fn the_bar_templates_parse() {
        for t in [SPINNER, STEPS, BYTES] {
            assert!(ProgressStyle::with_template(t).is_ok(), "{t}");
        }
    }

    #[test]
    fn every_pipeline_event_has_its_json() {
        let events = [
            Progress::Loading {
                component: "t5".into(),
                devices: "emu:0".into(),
            },
            Progress::Loaded {
                component: "t5".into(),
                devices: "emu:0".into(),
                seconds: 0.5,
                weight_bytes: 1 << 20,
            },
            Progress::Encoded {
                component: "t5".into(),
                seconds: 0.25,
                digest: Some(u64::MAX),
            },
            Progress::Released {
                component: "t5".into(),
            },
            Progress::Step {
                index: 2,
                steps: 4,
                t: 0.5,
                seconds: 0.125,
                digest: Some(0xab),
            },
            Progress::Decoded {
                devices: "emu:1".into(),
                seconds: 1.0,
                latents_digest: Some(1),
                image_digest: Some(2),
            },
            Progress::Note("n".into()),
            // A run without digests leaves the keys out.
            Progress::Step {
                index: 3,
                steps: 4,
                t: 0.25,
                seconds: 0.125,
                digest: None,
            },
            Progress::Decoded {
                devices: "emu:1".into(),
                seconds: 1.0,
                latents_digest: None,
                image_digest: None,
            },
        ];
        let got: Vec<Value> = events.iter().map(progress_event).collect();
        let want: Vec<Value> = [

                r#"{"component":"t5","devices":"emu:0","event":"loading"}"#,
                r#"{"component":"t5","devices":"emu:0","event":"loaded","seconds":0.5,"weight_bytes":1048576}"#,
                r#"{"component":"t5","digest":"ffffffffffffffff","event":"encoded","seconds":0.25}"#,
                r#"{"component":"t5","event":"released"}"#,
                r#"{"digest":"00000000000000ab","event":"step","index":2,"seconds":0.125,"steps":4,"t":0.5}"#,
                r#"{"devices":"emu:1","event":"decoded","image_digest":"0000000000000002","latents_digest":"0000000000000001","seconds":1.0}"#,
                r#"{"event":"note","message":"n"}"#,
                r#"{"event":"step","index":3,"seconds":0.125,"steps":4,"t":0.25}"#,
                r#"{"devices":"emu:1","event":"decoded","seconds":1.0}"#,
            ]
            .iter()
            .map(|s| serde_json::from_str(s).unwrap())
            .collect();
        assert_eq!(got, want);
    }
}
