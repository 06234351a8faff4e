//! How every benchmark reports: each run's raw numbers go to `target/bench/<bench>.csv` (so the medians can
//! be rechecked), and the table gives, per measure, the median with the spread (min to max) of its runs and
//! the ratio of the medians against a baseline measured in the same runs. Never the best run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

/// The samples of one benchmark, by measure name, in run order.
#[derive(Debug, Default)]
pub struct Report {
    bench: &'static str,
    samples: BTreeMap<String, Vec<f64>>,
    order: Vec<String>,
    rows: Vec<String>,
}

/// Median, min and max of `xs`.
pub fn stats(xs: &[f64]) -> (f64, f64, f64) {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    (median(&v), v.first().copied().unwrap_or(f64::NAN), v.last().copied().unwrap_or(f64::NAN))
}

/// The `pct`-th percentile (nearest rank) of `xs`.
pub fn percentile(xs: &[f64], pct: usize) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = (pct * v.len()).div_ceil(100).clamp(1, v.len());
    v[rank - 1]
}

/// The median of `xs`.
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn cell(xs: &[f64], digits: usize) -> String {
    let (m, lo, hi) = stats(xs);
    format!("{m:.digits$} ({lo:.digits$}-{hi:.digits$})")
}

impl Report {
    pub fn new(bench: &'static str) -> Self {
        Self { bench, ..Self::default() }
    }

    /// One run's value of `measure`.
    pub fn sample(&mut self, measure: &str, value: f64) {
        if !self.samples.contains_key(measure) {
            self.order.push(measure.to_owned());
        }
        self.samples.entry(measure.to_owned()).or_default().push(value);
    }

    /// Every value of `measure` so far.
    pub fn samples_of(&self, measure: &str) -> &[f64] {
        self.samples.get(measure).map_or(&[], Vec::as_slice)
    }

    /// The median of `measure` so far.
    pub fn median(&self, measure: &str) -> f64 {
        median(self.samples_of(measure))
    }

    /// A row comparing `ours` against `baseline`, both measures of this report.
    pub fn compare(&mut self, label: &str, ours: &str, baseline: &str, digits: usize, goal: &str) {
        let ratio = self.median(ours) / self.median(baseline);
        // A small ratio keeps its first significant digit.
        let ratio = if ratio < 0.1 { format!("{ratio:.3}") } else { format!("{ratio:.2}") };
        let row = format!(
            "| {label} | {} | {} | {ratio} | {goal} |",
            cell(self.samples_of(ours), digits),
            cell(self.samples_of(baseline), digits)
        );
        self.rows.push(row);
    }

    /// A row of one measure without a baseline.
    pub fn single(&mut self, label: &str, measure: &str, digits: usize, goal: &str) {
        let row = format!("| {label} | {} | - | - | {goal} |", cell(self.samples_of(measure), digits));
        self.rows.push(row);
    }

    /// Writes the raw samples and prints the table.
    pub fn finish(self, title: &str, runs: usize) {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
        let _ = std::fs::create_dir_all(&dir);
        let mut csv = String::from("measure,run,value\n");
        for measure in &self.order {
            for (run, value) in self.samples_of(measure).iter().enumerate() {
                let _ = writeln!(csv, "{measure},{},{value}", run + 1);
            }
        }
        let path = dir.join(format!("{}.csv", self.bench));
        std::fs::write(&path, csv).unwrap();
        println!("\n### {title}\n");
        println!(
            "`{}` bench, {runs} runs, accelerator {}; raw samples: `target/bench/{}.csv`.",
            self.bench,
            super::resolved_accel(),
            self.bench
        );
        println!("Cells: median (min-max).\n");
        println!("| measure | ours | baseline | ratio of medians | goal |");
        println!("|---|---|---|---|---|");
        for row in self.rows {
            println!("{row}");
        }
    }
}
