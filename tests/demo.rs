//! A shortened `prefixlb demo`: the same code path (in-process engines and balancer,
//! real HTTP), a smaller workload.

use std::time::Duration;

use prefixlb::tools::demo::{compare, report, DemoOptions};
use prefixlb::tools::engine_model::Costs;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefix_affinity_beats_round_robin_on_cache_hits() {
    let opts = DemoOptions {
        conversations: 16,
        turns: 3,
        concurrency: 4,
        answer_tokens: 8,
        cache_tokens: 12_000,
        costs: Costs {
            prefill_per_token: Duration::from_micros(20),
            decode_per_token: Duration::from_millis(1),
            ..Costs::default()
        },
        ..DemoOptions::default()
    };
    let (rr, lb) = compare(&opts).await.unwrap();
    for s in [&rr, &lb] {
        assert_eq!(s.requests, 48);
        assert_eq!(s.errors, 0);
        assert_eq!(s.ttft.len(), 48);
        assert!(s.prompt_tokens > 48 * 1500);
    }
    // Turns 2 and 3 of each conversation find their document cached only with affinity.
    assert!(lb.hit_rate > 0.55, "prefixlb hit rate {}", lb.hit_rate);
    assert!(
        lb.hit_rate > rr.hit_rate + 0.2,
        "prefixlb {} vs round-robin {}",
        lb.hit_rate,
        rr.hit_rate
    );
    let text = report(&opts, &rr, &lb, Duration::from_secs(1));
    assert!(
        text.contains("round-robin") && text.contains("verdict: prefixlb served"),
        "{text}"
    );
}
