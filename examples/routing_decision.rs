//! Routing decisions in a loop, for counting instructions rather than timing them
//! (criterion's medians swing by half on a shared host; instruction counts do not):
//!
//! ```sh
//! cargo build --release --example routing_decision
//! for n in 1000 3000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!   target/release/examples/routing_decision $n 2>&1 | grep refs; done
//! ```
//!
//! The difference of the two totals over 2,000 is the instructions of one decision
//! (`Table::place` and the walk's reservation, released) on 18 KB, 31-message chat
//! bodies of 1,024 conversations sharing a 2 KB system prompt, 8 nodes. A second
//! argument `dense` makes the turns escape-dense; `@path` places that one body every
//! time instead (e.g. the load scripts' 1 KB body).

use std::time::Instant;

use prefixlb::config::Config;
use prefixlb::routing::table::{Registry, Table};
use prefixlb::routing::walk::Walk;
use prefixlb::routing::Mode;

const PROSE: &str = "Prefix caching lets an engine skip prefill for tokens it has already seen. \
When a conversation returns to the same instance, its cached blocks are reused and the time \
to first token drops from seconds to milliseconds.\n\nA \"hot\" prefix, such as a shared \
system prompt, must not pin every request to one GPU; bounded loads spill the overflow.\n";

/// Escape-dense text (code, JSON, quoted dialogue): an escape every ~20 characters
/// (the second argument `dense` uses it for the turns, as the criterion bench does).
const DENSE: &str = "The quick brown fox jumps over the lazy dog; \"quoted\" text.\n";

fn text(n: usize) -> String {
    of(PROSE, n)
}

fn of(sentence: &str, n: usize) -> String {
    sentence.repeat(n / sentence.len() + 1)[..n].to_string()
}

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let turns = match std::env::args().nth(2).as_deref() {
        Some("dense") => DENSE,
        _ => PROSE,
    };
    let mut config = String::from("[[pools]]\nname = \"llama\"\nmodels = [\"llama\", \"mock\"]\n");
    for i in 0..8 {
        config.push_str(&format!(
            "[[pools.nodes]]\nid = \"gpu-{i}\"\nurl = \"http://10.0.0.{i}:8000\"\n"
        ));
    }
    let table = Table::build(
        Config::parse(&config, "example").unwrap(),
        &Registry::default(),
    );
    // `@path`: that one body every time (as the load scripts send theirs).
    let file = std::env::args().nth(2).and_then(|a| {
        a.strip_prefix('@')
            .map(|p| std::fs::read(p).expect("a body file"))
    });
    let bodies = match file {
        Some(body) => vec![body],
        None => conversations(turns),
    };
    let mut chosen = 0usize;
    for i in 0..n {
        let placement = table
            .place(
                "/v1/chat/completions",
                None,
                &bodies[i % bodies.len()],
                Mode::Route,
            )
            .unwrap();
        if let Walk::Chosen(c) = placement.choose(&[], Instant::now()) {
            chosen += c.index;
        }
    }
    println!("{n} decisions ({chosen})");
}

/// 1,024 conversations of 31 turns (`turns` text) behind a shared 2 KB system prompt.
fn conversations(turns: &str) -> Vec<Vec<u8>> {
    let system = text(2000);
    (0..1024)
        .map(|c| {
            let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
            for i in 0..31 {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(serde_json::json!({"role": role, "content": format!("conversation {c} turn {i}: {}", of(turns, 520))}));
            }
            serde_json::to_vec(&serde_json::json!({"messages": messages, "temperature": 0.7, "model": "llama", "stream": true})).unwrap()
        })
        .collect()
}
