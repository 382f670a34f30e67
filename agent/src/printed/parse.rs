//! Step lines as training scripts print them, each format checked against its project's source
//! (docs/receipts.md, "Printed step lines"). Pure: a line in, a [`Parsed`] out.
//!
//! Every step number becomes the hook's: the 0-based index of the training iteration it reports.
//!
//! | format | printed by | step printed | to the hook's step |
//! |---|---|---|---|
//! | nanochat `step 00010/01000 (1.00%) \| loss: ... \| dt: ...ms \| tok/sec: 1,234 \| bf16_mfu: ...` | rank 0, after the optimizer step | the step just done, from 0 | as printed |
//! | modded-nanogpt `step:10/1750 train_time:...ms step_avg:...ms` | rank 0, after the optimizer step | step + 1 | minus 1 |
//! | modded-nanogpt `step:10/1750 val_loss:... ` | rank 0, before step 10 trains | steps done | as printed (the evaluation's time is that step's) |
//! | torchtitan `step: 10  loss: ...  grad_norm: ...  tps: ...  mfu: ...%` (ANSI colours) | every rank that shows its log, after the optimizer step | counted from 1 | minus 1 |
//! | Megatron-LM `iteration 10/ 1000 \| ... \| lm loss: ... \|` | the last rank, after the optimizer step | counted from 1 | minus 1 |
//! | Hugging Face Trainer `{'loss': '2.5', 'grad_norm': ..., 'learning_rate': ..., 'epoch': ...}` | local rank 0, after the optimizer step | none | by order (see [`super`]) |
//! | a job's `[receipts] pattern` | any | its `step` group | as printed |

use std::collections::BTreeMap;

use regex::Regex;

/// Which format a line was read as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Nanochat,
    ModdedNanogpt,
    Torchtitan,
    Megatron,
    HfTrainer,
    Pattern,
}

impl Format {
    /// The source a field read from this format records (`sources` in the receipt).
    pub fn source(self) -> &'static str {
        match self {
            Format::Nanochat => "printed nanochat",
            Format::ModdedNanogpt => "printed modded-nanogpt",
            Format::Torchtitan => "printed torchtitan",
            Format::Megatron => "printed megatron",
            Format::HfTrainer => "printed transformers",
            Format::Pattern => "printed pattern",
        }
    }
}

/// One recognised step line.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLine {
    pub format: Format,
    /// The hook's step number; `None` for a format that prints none (Hugging Face's dict).
    pub step: Option<i64>,
    /// Schema v1 names (`loss`, `lr`, `grad_norm`, `tokens_per_s`, `mfu` as a fraction,
    /// `step_time_ms`) where the value is one, the script's own names otherwise.
    pub fields: BTreeMap<String, f64>,
}

/// What a line is.
#[derive(Debug, Clone, PartialEq)]
pub enum Parsed {
    Step(StepLine),
    /// Not a step line of any known format (most lines).
    Other,
    /// Looked like a step line but is not one: skipped and counted, never a receipt.
    Bad(String),
}

/// The parsers of one rank: the known formats, and the job's own pattern.
#[derive(Debug, Clone)]
pub struct Parser {
    nanochat: Regex,
    modded: Regex,
    titan: Regex,
    megatron: Regex,
    hf: Regex,
    ansi: Regex,
    /// `name: value` with the value padded (torchtitan's `loss:  5.12345`).
    padded_pair: Regex,
    pattern: Option<Regex>,
}

pub use trainyard_model::spec::receipts_pattern as compile_pattern;

impl Parser {
    /// The parsers, with the job's pattern (already checked at submit; one that fails here is
    /// the error).
    ///
    /// The built-in patterns are compiled once per agent and shared (a clone of a compiled
    /// `Regex` is cheap): compiled per rank, they cost a launch about 1.5 ms a rank, on the
    /// agent's one launch path.
    pub fn new(pattern: Option<&str>) -> Result<Parser, String> {
        static BUILT_IN: std::sync::LazyLock<Parser> = std::sync::LazyLock::new(|| {
            let re = |s: &str| Regex::new(s).expect("a built-in step-line pattern compiles");
            Parser {
                nanochat: re(r"^step (\d+)/(\d+) \(([\d.]+)%\) \| (.*)$"),
                modded: re(r"^step:(\d+)/(\d+) (\S.*)$"),
                titan: re(r"step:\s*(\d+)\s{2}(loss:.*)$"),
                megatron: re(r"iteration\s+(\d+)/\s*(\d+) \|(.*)$"),
                hf: re(r"^\{'(?:loss|eval_loss|grad_norm|learning_rate)': .*\}$"),
                ansi: re(r"\x1b\[[0-9;]*m"),
                padded_pair: re(r"([a-z_]+):\s*(\S+)"),
                pattern: None,
            }
        });
        Ok(Parser { pattern: pattern.map(compile_pattern).transpose()?, ..BUILT_IN.clone() })
    }

    /// Reads one line (without its newline).
    pub fn parse(&self, line: &str) -> Parsed {
        let line = line.trim_end_matches('\r');
        if let Some(re) = &self.pattern
            && let Some(c) = re.captures(line)
        {
            return pattern_line(re, &c);
        }
        if let Some(c) = self.nanochat.captures(line) {
            return nanochat(&c[1], &c[4]);
        }
        if let Some(c) = self.modded.captures(line) {
            return modded(&c[1], &c[3]);
        }
        if line.contains("iteration")
            && let Some(c) = self.megatron.captures(line)
        {
            return megatron(&c[1], &c[3]);
        }
        if line.contains("step:") && line.contains("loss:") {
            let plain = self.ansi.replace_all(line, "");
            if let Some(c) = self.titan.captures(&plain) {
                return torchtitan(&c[1], &c[2], &self.padded_pair);
            }
        }
        if line.starts_with("{'") && self.hf.is_match(line) {
            return hf_dict(line);
        }
        Parsed::Other
    }
}

/// A number as scripts print them: `1,234`, `5.1E-04`, `12.5%` (a percentage stays as
/// printed; the caller scales it), `1234.56ms`; `None` for anything else.
fn number(text: &str) -> Option<f64> {
    let t = text.trim().trim_matches('\'').trim_matches('"');
    let t = t.strip_suffix("ms").or_else(|| t.strip_suffix('%')).unwrap_or(t);
    let v: f64 = t.replace(',', "").parse().ok()?;
    Some(v)
}

fn step_number(text: &str, minus: i64) -> Result<i64, String> {
    let n: i64 = text.trim().parse().map_err(|_| format!("step {text:?} is not a number"))?;
    let step = n - minus;
    if step < 0 {
        return Err(format!("step {n} is before the first step"));
    }
    Ok(step)
}

/// A schema v1 name for a printed name, and the factor its value is scaled by.
fn schema(name: &str) -> (String, f64) {
    let n = name.trim().to_ascii_lowercase();
    let known = match n.as_str() {
        "loss" | "lm loss" | "train_loss" => Some(("loss", 1.0)),
        "lr" | "learning rate" | "learning_rate" => Some(("lr", 1.0)),
        "grad norm" | "grad_norm" => Some(("grad_norm", 1.0)),
        "tok/sec" | "tokens_per_s" | "tokens_per_sec" => Some(("tokens_per_s", 1.0)),
        "bf16_mfu" | "mfu" => Some(("mfu", 0.01)),
        "dt" | "elapsed time per iteration (ms)" | "step_time_ms" => Some(("step_time_ms", 1.0)),
        _ => None,
    };
    match known {
        Some((s, f)) => (s.to_string(), f),
        None => (n.replace(' ', "_"), 1.0),
    }
}

/// Fills `fields` from `name: value` pairs; a value that is not a number is left out, unless
/// the name is a schema field, which makes the line bad (`nan` included).
fn pairs<'a>(
    it: impl Iterator<Item = (&'a str, &'a str)>,
    fields: &mut BTreeMap<String, f64>,
) -> Result<(), String> {
    for (name, value) in it {
        let (key, factor) = schema(name);
        let known =
            matches!(key.as_str(), "loss" | "lr" | "grad_norm" | "tokens_per_s" | "mfu" | "step_time_ms");
        match number(value) {
            Some(v) if v.is_finite() => {
                fields.insert(key, v * factor);
            }
            _ if value.trim() == "N/A" => {}
            _ if known => return Err(format!("{name} {:?} is not a finite number", value.trim())),
            _ => {}
        }
    }
    Ok(())
}

fn finish(
    format: Format,
    step: Result<Option<i64>, String>,
    fields: Result<BTreeMap<String, f64>, String>,
) -> Parsed {
    match (step, fields) {
        (Ok(step), Ok(fields)) => Parsed::Step(StepLine { format, step, fields }),
        (Err(e), _) | (_, Err(e)) => Parsed::Bad(format!("{}: {e}", format.source())),
    }
}

/// `step 00010/01000 (1.00%) | loss: 8.317800 | lrm: 1.00 | dt: 1234.56ms | tok/sec: 1,234 |
/// bf16_mfu: 12.34 | epoch: 1 pq: 0 rg: 3 | total time: 0.21m | eta: 1.2m`. Its loss is a
/// debiased moving average, kept as `loss_smoothed` (not `loss`).
fn nanochat(step: &str, rest: &str) -> Parsed {
    let mut fields = BTreeMap::new();
    let kv = rest.split(" | ").filter_map(|p| p.split_once(": "));
    let r = pairs(kv.filter(|(k, _)| !matches!(*k, "epoch" | "total time" | "eta")), &mut fields);
    if let Some(loss) = fields.remove("loss") {
        fields.insert("loss_smoothed".into(), loss);
    }
    finish(Format::Nanochat, step_number(step, 0).map(Some), r.map(|()| fields))
}

/// `step:10/1750 train_time:1234ms step_avg:123.40ms` (printed after step 9) or
/// `step:10/1750 val_loss:4.1234 train_time:... step_avg:...` (before step 10).
fn modded(step: &str, rest: &str) -> Parsed {
    let mut fields = BTreeMap::new();
    let kv: Vec<(&str, &str)> = rest.split_whitespace().filter_map(|p| p.split_once(':')).collect();
    let val = kv.iter().any(|(k, _)| *k == "val_loss");
    let r = pairs(kv.into_iter(), &mut fields);
    finish(Format::ModdedNanogpt, step_number(step, if val { 0 } else { 1 }).map(Some), r.map(|()| fields))
}

/// `step: 10  loss:  5.12345  grad_norm:  1.2345  memory: 12.34GiB(15.60%)  tps: 1,234
/// tflops: 123.45  mfu: 12.50%` (colours removed). `tps` is per GPU: kept as `tps`.
fn torchtitan(step: &str, rest: &str, pair: &Regex) -> Parsed {
    let mut fields = BTreeMap::new();
    let kv = pair
        .captures_iter(rest)
        .filter_map(|c| Some((c.get(1)?.as_str(), c.get(2)?.as_str())))
        .filter(|(k, _)| *k != "memory");
    let kv = kv.map(|(k, v)| (if k.trim() == "tps" { "tps_per_gpu" } else { k }, v));
    let r = pairs(kv, &mut fields);
    finish(Format::Torchtitan, step_number(step, 1).map(Some), r.map(|()| fields))
}

/// ` [2024-..] iteration       10/    1000 | consumed samples: ... | elapsed time per iteration
/// (ms): 1234.5 | learning rate: 1.000000E-04 | global batch size: 32 | lm loss: 5.123456E+00 |
/// loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations: 0 | ...`
fn megatron(step: &str, rest: &str) -> Parsed {
    let mut fields = BTreeMap::new();
    let kv = rest.split(" |").filter_map(|p| p.trim().rsplit_once(": "));
    let r = pairs(kv, &mut fields);
    finish(Format::Megatron, step_number(step, 1).map(Some), r.map(|()| fields))
}

/// `{'loss': '2.5', 'grad_norm': '1.2', 'learning_rate': '5e-05', 'epoch': '0.1'}`: floats
/// printed as strings of 4 significant digits (transformers 5), ints as ints.
fn hf_dict(line: &str) -> Parsed {
    let inner = &line[1..line.len() - 1];
    let mut fields = BTreeMap::new();
    let kv = inner.split(", ").filter_map(|p| p.split_once(": ")).map(|(k, v)| (k.trim_matches('\''), v));
    let r = pairs(kv, &mut fields);
    finish(Format::HfTrainer, Ok(None), r.map(|()| fields))
}

/// A job's pattern: `step` and every other named group that holds a number.
fn pattern_line(re: &Regex, c: &regex::Captures<'_>) -> Parsed {
    let step = c.name("step").map_or(Err("no step".to_string()), |m| step_number(m.as_str(), 0));
    let mut fields = BTreeMap::new();
    let kv =
        re.capture_names().flatten().filter(|n| *n != "step").filter_map(|n| Some((n, c.name(n)?.as_str())));
    let r = pairs(kv, &mut fields);
    finish(Format::Pattern, step.map(Some), r.map(|()| fields))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(line: &str) -> StepLine {
        match Parser::new(None).unwrap().parse(line) {
            Parsed::Step(s) => s,
            other => panic!("{line:?} gave {other:?}"),
        }
    }

    #[test]
    fn nanochat_as_base_train_prints_it() {
        let s = step(
            "step 00010/01000 (1.00%) | loss: 8.317800 | lrm: 1.00 | dt: 1234.56ms | tok/sec: 1,234,567 | bf16_mfu: 12.34 | epoch: 1 pq: 0 rg: 3 | total time: 0.21m | eta: 1.2m",
        );
        assert_eq!((s.format, s.step), (Format::Nanochat, Some(10)));
        assert_eq!(s.fields["loss_smoothed"], 8.3178, "a moving average is not the step's loss");
        assert!(!s.fields.contains_key("loss"));
        assert_eq!(s.fields["step_time_ms"], 1234.56);
        assert_eq!(s.fields["tokens_per_s"], 1_234_567.0);
        assert!((s.fields["mfu"] - 0.1234).abs() < 1e-12);
        assert_eq!(s.fields["lrm"], 1.0);
        assert!(!s.fields.contains_key("epoch") && !s.fields.contains_key("eta"));
        assert_eq!(step("step 00000/00020 (0.00%) | loss: 10.0 | lrm: 1.00 | dt: 5.00ms | tok/sec: 12 | bf16_mfu: 0.01 | epoch: 1 pq: 0 rg: 0 | total time: 0.00m").step, Some(0));
    }

    #[test]
    fn modded_nanogpt_train_and_validation_lines() {
        let s = step("step:10/1750 train_time:1234ms step_avg:123.40ms");
        assert_eq!((s.format, s.step), (Format::ModdedNanogpt, Some(9)), "printed as step + 1");
        assert_eq!((s.fields["train_time"], s.fields["step_avg"]), (1234.0, 123.4));
        let v = step("step:125/1750 val_loss:4.1234 train_time:15000ms step_avg:120.00ms");
        assert_eq!((v.step, v.fields["val_loss"]), (Some(125), 4.1234), "before step 125 trains");
    }

    #[test]
    fn torchtitan_with_its_colours() {
        let line = "[titan] 2025-01-01 10:00:00,000 - root - INFO - \x1b[31mstep: 10  \x1b[32mloss:  5.12345  \x1b[38;2;180;60;0mgrad_norm:  1.2345  \x1b[38;2;54;234;195mmemory: 12.34GiB(15.60%)  \x1b[34mtps: 1,234  \x1b[36mtflops: 123.45  \x1b[35mmfu: 12.50%\x1b[39m";
        let s = step(line);
        assert_eq!((s.format, s.step), (Format::Torchtitan, Some(9)), "counted from 1");
        assert_eq!(
            (s.fields["loss"], s.fields["grad_norm"], s.fields["tps_per_gpu"]),
            (5.12345, 1.2345, 1234.0)
        );
        assert!((s.fields["mfu"] - 0.125).abs() < 1e-12);
        assert!(!s.fields.contains_key("memory"));
        let na = step(
            "step:  1  loss: 10.00000  grad_norm:  1.0000  memory:  1.00GiB(1.00%)  tps: 12  tflops: 0.00  mfu: N/A",
        );
        assert_eq!(na.step, Some(0));
        assert!(!na.fields.contains_key("mfu"), "N/A is no value");
    }

    #[test]
    fn megatron_from_its_last_rank() {
        let s = step(
            " [2025-01-01 10:00:00.000000] iteration       10/    1000 | consumed samples:          320 | elapsed time per iteration (ms): 1234.5 | learning rate: 1.000000E-04 | global batch size:    32 | lm loss: 5.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
        );
        assert_eq!((s.format, s.step), (Format::Megatron, Some(9)));
        assert_eq!((s.fields["loss"], s.fields["lr"], s.fields["step_time_ms"]), (5.123456, 1e-4, 1234.5));
        assert_eq!((s.fields["grad_norm"], s.fields["global_batch_size"]), (1.234, 32.0));
    }

    #[test]
    fn hugging_face_dicts_carry_no_step() {
        let s =
            step("{'loss': '3.776', 'grad_norm': '0.9808', 'learning_rate': '0.0005', 'epoch': '0.01953'}");
        assert_eq!((s.format, s.step), (Format::HfTrainer, None));
        assert_eq!(
            (s.fields["loss"], s.fields["grad_norm"], s.fields["lr"], s.fields["epoch"]),
            (3.776, 0.9808, 0.0005, 0.01953)
        );
        assert_eq!(step("{'loss': 2.5, 'learning_rate': 5e-05, 'epoch': 1}").fields["loss"], 2.5);
    }

    #[test]
    fn lines_that_look_like_steps_but_are_not_are_bad_and_others_are_other() {
        let p = Parser::new(None).unwrap();
        for bad in [
            "step 00010/01000 (1.00%) | loss: nan | dt: 5.00ms",
            "step 00010/01000 (1.00%) | loss: 1.0 | dt: fastms",
            "step:0/10 train_time:0ms step_avg:0.00ms",
            " iteration 99999999999999999999/ 10 | lm loss: 1.0 |",
        ] {
            assert!(matches!(p.parse(bad), Parsed::Bad(_)), "{bad:?} gave {:?}", p.parse(bad));
        }
        for other in ["", "epoch 1 done", "Loading checkpoint step 5", "{'eval_runtime': 1.0}", "step: x"] {
            assert_eq!(p.parse(other), Parsed::Other, "{other:?}");
        }
    }

    #[test]
    fn a_jobs_pattern_is_checked_and_maps_its_groups() {
        let p = Parser::new(Some(
            r"^it=(?P<step>\d+) loss=(?P<loss>\S+) thr=(?P<tokens_per_s>[\d,]+) note=(?P<note>\w+)$",
        ))
        .unwrap();
        match p.parse("it=7 loss=2.5 thr=1,000 note=ok") {
            Parsed::Step(s) => {
                assert_eq!((s.format, s.step), (Format::Pattern, Some(7)));
                assert_eq!((s.fields["loss"], s.fields["tokens_per_s"]), (2.5, 1000.0));
                assert!(!s.fields.contains_key("note"), "not a number");
            }
            other => panic!("{other:?}"),
        }
        assert!(compile_pattern("(unclosed").unwrap_err().contains("does not compile"));
        assert!(compile_pattern(r"loss=(?P<loss>\S+)").unwrap_err().contains("no named group `step`"));
        assert!(compile_pattern(&"a".repeat(2000)).unwrap_err().contains("at most 1024"));
    }
}
