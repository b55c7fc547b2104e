//! A hand-written SVG timeline: per device a compute, a copy and a communication lane,
//! its memory against the budget, and a time axis.

use crate::text::{human, secs};
use crate::{EventKind, Lane, SimReport};
use std::fmt::Write;

const W: f64 = 1400.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 30.0;
const LANE_H: f64 = 16.0;
const MEM_H: f64 = 64.0;
const GAP: f64 = 22.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn color(k: EventKind) -> &'static str {
    match k {
        EventKind::Encoder => "#8e6cc0",
        EventKind::Vae => "#c0609a",
        EventKind::Block => "#4a7bd0",
        EventKind::StreamedBlock => "#2a9d8f",
        EventKind::Copy => "#e0902f",
        EventKind::AllReduce => "#d04a4a",
        EventKind::AllToAll => "#e06a9a",
        EventKind::AllGather => "#a04ad0",
        EventKind::HandOff => "#3a9a3a",
        EventKind::Transfer => "#8a8a8a",
    }
}

/// Maps time to x: linear, or piecewise (encode, steps, decode) when encode or decode
/// would take most of the width.
struct Axis {
    /// (t0, t1, x0, x1) per phase.
    segs: Vec<(f64, f64, f64, f64)>,
    broken: bool,
}

impl Axis {
    fn new(r: &SimReport, pw: f64) -> Axis {
        let end = r.sim_end_s.max(1e-9);
        let ds = r.denoise_start_s.clamp(0.0, end);
        let de = r.step_ends_s.last().copied().unwrap_or(ds).clamp(ds, end);
        let phases = [(0.0, ds, 0.15), (ds, de, 1.0), (de, end, 0.10)];
        let natural: Vec<f64> = phases.iter().map(|p| (p.1 - p.0) / end).collect();
        let broken = natural[0] > 0.3 || natural[2] > 0.3;
        let shares: Vec<f64> = if broken {
            let e = natural[0].min(phases[0].2);
            let d = natural[2].min(phases[2].2);
            vec![e, 1.0 - e - d, d]
        } else {
            natural
        };
        let mut segs = Vec::new();
        let mut x0 = LEFT;
        for (p, share) in phases.iter().zip(shares) {
            let x1 = x0 + share * pw;
            segs.push((p.0, p.1, x0, x1));
            x0 = x1;
        }
        Axis { segs, broken }
    }

    fn x(&self, t: f64) -> f64 {
        for &(t0, t1, x0, x1) in &self.segs {
            if t <= t1 {
                if t1 <= t0 {
                    return x0;
                }
                return x0 + (t.max(t0) - t0) / (t1 - t0) * (x1 - x0);
            }
        }
        self.segs.last().map(|s| s.3).unwrap_or(LEFT)
    }
}

/// A round tick spacing near `span / 8`.
fn tick_step(span: f64) -> f64 {
    let raw = (span / 8.0).max(1e-9);
    let p = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * p >= raw {
            return m * p;
        }
    }
    10.0 * p
}

impl SimReport {
    /// The timeline as a standalone SVG document.
    pub fn svg(&self) -> String {
        let t_end = self.sim_end_s.max(1e-9);
        let pw = W - LEFT - RIGHT;
        let axis = Axis::new(self, pw);
        let x = |t: f64| axis.x(t);
        let (unit, scale) = if t_end < 1.0 { ("ms", 1e3) } else { ("s", 1.0) };

        // Devices worth drawing: any with events or memory, then the host if it runs.
        let mut rows: Vec<(String, String, Option<usize>)> = Vec::new();
        for (i, d) in self.devices.iter().enumerate() {
            let has = d.peak > 0 || self.events.iter().any(|e| e.device == d.device);
            if has {
                rows.push((d.device.to_string(), d.name.clone(), Some(i)));
            }
        }
        if self.events.iter().any(|e| e.device.is_host()) {
            rows.push(("host".into(), "CPU".into(), None));
        }

        let top = 112.0;
        let group_h = 3.0 * LANE_H + 6.0 + MEM_H + GAP;
        let axis_y = top + rows.len() as f64 * group_h + 8.0;
        let h = axis_y + 50.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h:.0}" viewBox="0 0 {W} {h:.0}" font-family="sans-serif" font-size="11">"#
        );
        let _ = writeln!(
            s,
            r##"<rect x="0" y="0" width="{W}" height="{h:.0}" fill="#ffffff"/>"##
        );
        let w = &self.workload;
        let _ = writeln!(
            s,
            r#"<text x="10" y="20" font-size="15" font-weight="bold">{}</text>"#,
            esc(&format!(
                "mold sim: {} on {}, {}x{}, {} steps, batch {}",
                self.model, self.machine, w.width, w.height, self.steps, w.batch
            ))
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="38">{}</text>"#,
            esc(&format!(
                "One request: encode, denoising steps 1–{} simulated event by event, decode. {}.",
                self.simulated_steps,
                self.steps_note()
            ))
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="54">{}</text>"#,
            esc(&format!(
                "step {} · request {} = encode {} + {} steps {} + decode {} · {}",
                secs(self.step_s),
                secs(self.request_s),
                secs(self.encode_s),
                self.steps,
                secs(self.denoise_s),
                secs(self.decode_s),
                if self.fits() {
                    "fits".to_string()
                } else {
                    format!("OVER BUDGET: {}", self.overflows[0].message)
                }
            ))
        );
        let _ = writeln!(
            s,
            r#"<text x="10" y="70">{}</text>"#,
            esc(&format!("bottleneck: {}", self.bottleneck))
        );
        // Legend.
        let mut lx = 10.0;
        for (k, name) in [
            (EventKind::Encoder, "encoder"),
            (EventKind::Block, "resident block"),
            (EventKind::StreamedBlock, "streamed block"),
            (EventKind::Copy, "host→device copy"),
            (EventKind::AllReduce, "all-reduce"),
            (EventKind::AllToAll, "all-to-all"),
            (EventKind::AllGather, "all-gather"),
            (EventKind::HandOff, "hand-off"),
            (EventKind::Transfer, "conditioning / latents"),
            (EventKind::Vae, "VAE"),
        ] {
            let _ = writeln!(
                s,
                r#"<rect x="{lx}" y="80" width="12" height="10" fill="{}"/><text x="{}" y="89">{name}</text>"#,
                color(k),
                lx + 16.0
            );
            lx += 24.0 + 6.5 * name.len() as f64;
        }
        let _ = writeln!(
            s,
            r##"<line x1="{lx}" y1="85" x2="{}" y2="85" stroke="#c00" stroke-dasharray="4 2"/><text x="{}" y="89">budget</text>"##,
            lx + 20.0,
            lx + 24.0
        );

        // Phase markers.
        let mut marks: Vec<(f64, String)> = vec![(0.0, "encode".into())];
        let mut prev = self.denoise_start_s;
        for (i, e) in self.step_ends_s.iter().enumerate() {
            marks.push((prev, format!("step {}", i + 1)));
            prev = *e;
        }
        marks.push((prev, "decode".into()));
        let mut last_label = f64::INFINITY;
        for (t, label) in marks.iter().rev() {
            // Labels right to left: a label crowded by the next one is left out.
            let show = last_label - x(*t) >= 44.0;
            if show {
                last_label = x(*t);
            }
            let label = if show { label.as_str() } else { "" };
            let _ = writeln!(
                s,
                r##"<line x1="{0:.2}" y1="{1}" x2="{0:.2}" y2="{2:.1}" stroke="#999" stroke-dasharray="2 3"/><text x="{3:.2}" y="{4}" fill="#555">{5}</text>"##,
                x(*t),
                top - 8.0,
                axis_y,
                x(*t) + 3.0,
                top - 10.0,
                esc(label)
            );
        }

        for (ri, (id, name, dev)) in rows.iter().enumerate() {
            let y0 = top + ri as f64 * group_h;
            let _ = writeln!(
                s,
                r#"<g class="device" id="dev-{}">"#,
                esc(&id.replace(':', "-"))
            );
            let _ = writeln!(
                s,
                r##"<text x="8" y="{:.1}" font-weight="bold">{}</text><text x="8" y="{:.1}" fill="#555" font-size="9">{}</text>"##,
                y0 + 11.0,
                esc(id),
                y0 + 23.0,
                esc(&trunc(name, 20))
            );
            for (li, lane) in [Lane::Compute, Lane::Copy, Lane::Comm]
                .into_iter()
                .enumerate()
            {
                let ly = y0 + li as f64 * LANE_H;
                let _ = writeln!(
                    s,
                    r##"<g class="lane" data-lane="{0}"><rect x="{1}" y="{2:.1}" width="{3:.1}" height="{4}" fill="#f4f4f4" stroke="#ddd"/><text x="{5}" y="{6:.1}" text-anchor="end" fill="#333">{0}</text>"##,
                    lane.name(),
                    LEFT,
                    ly,
                    pw,
                    LANE_H - 2.0,
                    LEFT - 6.0,
                    ly + 11.0
                );
                for e in self
                    .events
                    .iter()
                    .filter(|e| e.device.to_string() == *id && e.lane == lane)
                {
                    let x0 = x(e.start_s);
                    let wd = (x(e.end_s) - x0).max(0.6);
                    // True CFG's second pass (or micro-batch) in a lighter shade, so the
                    // two show apart where they overlap across devices.
                    let second = e.phase.contains(", mb1,") || e.phase.contains(", uncond,");
                    let _ = writeln!(
                        s,
                        r#"<rect x="{x0:.2}" y="{:.1}" width="{wd:.2}" height="{}" fill="{}"{}><title>{}</title></rect>"#,
                        ly + 1.0,
                        LANE_H - 4.0,
                        color(e.kind),
                        if second {
                            r#" fill-opacity="0.55""#
                        } else {
                            ""
                        },
                        esc(&format!(
                            "{} — {}: {} ({} → {})",
                            e.phase,
                            e.what,
                            secs(e.duration_s()),
                            secs(e.start_s),
                            secs(e.end_s)
                        ))
                    );
                }
                let _ = writeln!(s, "</g>");
            }
            // Memory against the budget.
            let my = y0 + 3.0 * LANE_H + 4.0;
            if let Some(i) = dev {
                let d = &self.devices[*i];
                let max = (d.budget.max(d.peak + d.headroom) as f64 * 1.05).max(1.0);
                let yv = |b: f64| my + MEM_H - b / max * MEM_H;
                let _ = writeln!(
                    s,
                    r##"<g class="memory"><rect x="{LEFT}" y="{my:.1}" width="{pw:.1}" height="{MEM_H}" fill="#fbfbfb" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#333">memory</text><text x="{:.1}" y="{:.1}" text-anchor="end" fill="#777" font-size="9">0 – {}</text>"##,
                    LEFT - 6.0,
                    my + 14.0,
                    LEFT - 6.0,
                    my + 26.0,
                    esc(&human(max as u64))
                );
                let mut pts = String::new();
                let mut last = 0u64;
                for &(t, b) in &d.curve {
                    let _ = write!(pts, "{:.2},{:.2} ", x(t), yv(last as f64));
                    let _ = write!(pts, "{:.2},{:.2} ", x(t), yv(b as f64));
                    last = b;
                }
                let _ = write!(pts, "{:.2},{:.2}", x(t_end), yv(last as f64));
                let _ = writeln!(
                    s,
                    r##"<polyline points="{pts}" fill="none" stroke="#2b5fb4" stroke-width="1.2"/>"##
                );
                let by = yv(d.budget as f64);
                let uy = yv((d.budget - d.headroom.min(d.budget)) as f64);
                let _ = writeln!(
                    s,
                    r##"<line x1="{LEFT}" y1="{by:.2}" x2="{:.1}" y2="{by:.2}" stroke="#c00" stroke-dasharray="4 2"/><text x="{:.1}" y="{:.2}" text-anchor="end" fill="#c00" font-size="9">budget {}</text>"##,
                    LEFT + pw,
                    LEFT + pw - 2.0,
                    by - 2.0,
                    esc(&human(d.budget))
                );
                let _ = writeln!(
                    s,
                    r##"<line x1="{LEFT}" y1="{uy:.2}" x2="{:.1}" y2="{uy:.2}" stroke="#e08080" stroke-dasharray="1 2"/>"##,
                    LEFT + pw
                );
                let px = x(d.peak_at_s);
                let py = yv(d.peak as f64);
                let _ = writeln!(
                    s,
                    r##"<circle cx="{px:.2}" cy="{py:.2}" r="2.5" fill="#2b5fb4"><title>{}</title></circle><text x="{:.2}" y="{:.2}" fill="#2b5fb4" font-size="9">{}</text></g>"##,
                    esc(&format!(
                        "peak {} at {}: {}",
                        human(d.peak),
                        d.peak_moment,
                        crate::text::live_list(&d.peak_live)
                    )),
                    (px + 4.0).min(LEFT + pw - 260.0),
                    (py + 10.0).min(my + MEM_H - 2.0),
                    esc(&format!(
                        "peak {} + headroom {} at {}",
                        human(d.peak),
                        human(d.headroom),
                        d.peak_moment
                    ))
                );
            } else {
                let _ = writeln!(
                    s,
                    r##"<text x="{LEFT}" y="{:.1}" fill="#777">host memory {} of {}; pinned {} of {}</text>"##,
                    my + 14.0,
                    human(self.host.ram),
                    human(self.host.memory),
                    human(self.host.pinned),
                    human(self.host.pinned_limit)
                );
            }
            let _ = writeln!(s, "</g>");
        }

        // Time axis: one linear scale, or, when encode or decode would crowd out the
        // steps, each phase at its own scale with a break between them.
        let _ = writeln!(
            s,
            r##"<g class="axis"><line x1="{LEFT}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="#333"/>"##,
            LEFT + pw
        );
        for (si, &(t0, t1, x0, x1)) in axis.segs.iter().enumerate() {
            if t1 <= t0 || x1 - x0 < 1.0 {
                continue;
            }
            let step = tick_step((t1 - t0) * pw / (x1 - x0));
            let digits = (-(step * scale).log10().floor()).max(0.0) as usize;
            let mut t = (t0 / step).ceil() * step;
            let mut last_x = f64::NEG_INFINITY;
            while t <= t1 * (1.0 + 1e-9) {
                let tx = axis.x(t);
                if tx - last_x >= 36.0 {
                    let v = t * scale;
                    let _ = writeln!(
                        s,
                        r##"<line x1="{tx:.2}" y1="{axis_y:.1}" x2="{tx:.2}" y2="{:.1}" stroke="#333"/><text x="{tx:.2}" y="{:.1}" text-anchor="middle">{v:.digits$}</text>"##,
                        axis_y + 5.0,
                        axis_y + 18.0
                    );
                    last_x = tx;
                }
                t += step;
            }
            if axis.broken && si + 1 < axis.segs.len() {
                let bx = x1;
                let _ = writeln!(
                    s,
                    r##"<path d="M{:.1},{:.1} l6,-10 M{:.1},{:.1} l6,-10" stroke="#c00" stroke-width="1.5"/>"##,
                    bx - 5.0,
                    axis_y + 5.0,
                    bx - 1.0,
                    axis_y + 5.0
                );
            }
        }
        let scales = if axis.broken {
            "; encode, steps and decode each drawn at their own scale (red breaks)"
        } else {
            ""
        };
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">time ({unit}) from the request's start{scales}</text></g>"#,
            LEFT + pw / 2.0,
            axis_y + 36.0
        );
        s.push_str("</svg>\n");
        s
    }
}

fn trunc(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        let mut t: String = s.chars().take(n - 1).collect();
        t.push('…');
        t
    }
}
