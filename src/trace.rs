//! Traces a person can open: Chrome/Perfetto trace-event JSON (`chrome://tracing`,
//! `ui.perfetto.dev`) and a self-contained SVG timeline (any browser). One track per rank and
//! stream; spans are coloured by category (compute, pack, all-reduce, unpack, wait).

use std::fmt::Write;

use serde_json::json;

/// What a span is: its category in a trace and its colour in a timeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A compute op (forward, backward, an optimizer step).
    Compute,
    /// Packing gradients into a bucket.
    Pack,
    /// A collective.
    AllReduce,
    /// Copying a reduced bucket back into gradients.
    Unpack,
    /// Waiting for a collective.
    Wait,
}

impl SpanKind {
    /// Every kind, in legend order.
    pub const ALL: [SpanKind; 5] = [
        SpanKind::Compute,
        SpanKind::Pack,
        SpanKind::AllReduce,
        SpanKind::Unpack,
        SpanKind::Wait,
    ];

    /// The category's name in traces: `compute`, `pack`, `all-reduce`, `unpack`, `wait`.
    pub fn name(self) -> &'static str {
        match self {
            SpanKind::Compute => "compute",
            SpanKind::Pack => "pack",
            SpanKind::AllReduce => "all-reduce",
            SpanKind::Unpack => "unpack",
            SpanKind::Wait => "wait",
        }
    }

    /// The stream it runs on: `comm` for a collective, `compute` for everything else (packs,
    /// unpacks and waits are the compute stream's).
    pub fn stream(self) -> &'static str {
        match self {
            SpanKind::AllReduce => "comm",
            _ => "compute",
        }
    }

    fn colour(self) -> &'static str {
        match self {
            SpanKind::Compute => "#4c78a8",
            SpanKind::Pack => "#f58518",
            SpanKind::Unpack => "#e45756",
            SpanKind::AllReduce => "#54a24b",
            SpanKind::Wait => "#bab0ac",
        }
    }
}

impl std::fmt::Display for SpanKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One span on one track.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceSpan {
    /// Rank the span ran on.
    pub rank: usize,
    /// Stream: `compute` or `comm`.
    pub stream: String,
    /// What it is.
    pub cat: SpanKind,
    /// Label.
    pub name: String,
    /// Start, microseconds from the start of the trace.
    pub start_us: f64,
    /// Duration, microseconds.
    pub dur_us: f64,
}

/// Tracks in display order: by rank, compute before comm.
fn tracks(spans: &[TraceSpan]) -> Vec<(usize, String)> {
    let mut t: Vec<(usize, String)> = spans.iter().map(|s| (s.rank, s.stream.clone())).collect();
    t.sort_by(|a, b| (a.0, a.1 != "compute", &a.1).cmp(&(b.0, b.1 != "compute", &b.1)));
    t.dedup();
    t
}

/// Chrome trace-event JSON: one process per rank, one thread per stream, complete (`X`) events
/// sorted by track then start.
pub fn chrome_json(title: &str, spans: &[TraceSpan]) -> String {
    let tracks = tracks(spans);
    let tid = |rank: usize, stream: &str| {
        tracks
            .iter()
            .position(|(r, s)| *r == rank && s == stream)
            .unwrap_or(0)
    };
    let mut events = Vec::new();
    for (rank, stream) in &tracks {
        events.push(
            json!({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
            "args": {"name": format!("rank {rank}")}}),
        );
        events.push(
            json!({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid(*rank, stream),
            "args": {"name": stream}}),
        );
        events.push(json!({"ph": "M", "name": "thread_sort_index", "pid": rank,
            "tid": tid(*rank, stream), "args": {"sort_index": tid(*rank, stream)}}));
    }
    let mut sorted: Vec<&TraceSpan> = spans.iter().collect();
    sorted.sort_by(|a, b| {
        (a.rank, tid(a.rank, &a.stream))
            .cmp(&(b.rank, tid(b.rank, &b.stream)))
            .then(a.start_us.total_cmp(&b.start_us))
    });
    for s in sorted {
        events.push(json!({
            "ph": "X", "name": s.name, "cat": s.cat.name(), "pid": s.rank, "tid": tid(s.rank, &s.stream),
            "ts": round3(s.start_us), "dur": round3(s.dur_us),
        }));
    }
    let doc = json!({
        "displayTimeUnit": "ms",
        "otherData": {"title": title},
        "traceEvents": events,
    });
    serde_json::to_string_pretty(&doc).unwrap_or_default()
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A self-contained SVG timeline: one row per track, a time axis, a legend; each span has a
/// `<title>` with its name and times (hover in a browser).
pub fn svg(title: &str, spans: &[TraceSpan]) -> String {
    let end = spans
        .iter()
        .map(|s| s.start_us + s.dur_us)
        .fold(0.0f64, f64::max);
    svg_between(title, spans, 0.0, end)
}

/// [`svg`] of the window `[from_us, to_us]` only (spans clipped to it, times shown from its
/// start): one step of a long run, say.
pub fn svg_between(title: &str, spans: &[TraceSpan], from_us: f64, to_us: f64) -> String {
    let clipped: Vec<TraceSpan> = spans
        .iter()
        .filter(|s| s.start_us < to_us && s.start_us + s.dur_us > from_us)
        .map(|s| {
            let start = s.start_us.max(from_us);
            let end = (s.start_us + s.dur_us).min(to_us);
            TraceSpan {
                start_us: start - from_us,
                dur_us: end - start,
                ..s.clone()
            }
        })
        .collect();
    svg_spans(title, &clipped)
}

fn svg_spans(title: &str, spans: &[TraceSpan]) -> String {
    let tracks = tracks(spans);
    let end = spans
        .iter()
        .map(|s| s.start_us + s.dur_us)
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let (left, width, row, top) = (150.0, 1000.0, 28.0, 50.0);
    let height = top + row * tracks.len() as f64 + 60.0;
    let x = |t: f64| left + t / end * width;
    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{height}" font-family="sans-serif" font-size="12">"#,
        left + width + 20.0
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        out,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
        escape(title)
    );
    for (i, (rank, stream)) in tracks.iter().enumerate() {
        let y = top + row * i as f64;
        let _ = writeln!(
            out,
            r#"<text x="10" y="{}">rank {rank} · {}</text>"#,
            y + row * 0.65,
            escape(stream)
        );
        let _ = writeln!(
            out,
            "<line x1=\"{left}\" x2=\"{}\" y1=\"{}\" y2=\"{}\" stroke=\"#ddd\"/>",
            left + width,
            y + row,
            y + row
        );
        for s in spans
            .iter()
            .filter(|s| s.rank == *rank && &s.stream == stream)
        {
            let w = (x(s.start_us + s.dur_us) - x(s.start_us)).max(0.5);
            let _ = writeln!(
                out,
                r#"<rect x="{:.2}" y="{}" width="{w:.2}" height="{}" fill="{}"><title>{} ({}): {:.1} µs at {:.1} µs</title></rect>"#,
                x(s.start_us),
                y + 3.0,
                row - 6.0,
                s.cat.colour(),
                escape(&s.name),
                s.cat.name(),
                s.dur_us,
                s.start_us
            );
        }
    }
    // Time axis with five ticks.
    let axis_y = top + row * tracks.len() as f64 + 15.0;
    for k in 0..=5 {
        let t = end * f64::from(k) / 5.0;
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{axis_y}" text-anchor="middle">{}</text>"#,
            x(t),
            fmt_us(t)
        );
    }
    let mut lx = left;
    for cat in SpanKind::ALL {
        let _ = writeln!(
            out,
            r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{cat}</text>"#,
            axis_y + 15.0,
            cat.colour(),
            lx + 16.0,
            axis_y + 25.0
        );
        lx += 110.0;
    }
    out.push_str("</svg>\n");
    out
}

fn fmt_us(t: f64) -> String {
    if t >= 1000.0 {
        format!("{:.2} ms", t / 1000.0)
    } else {
        format!("{t:.0} µs")
    }
}
