//! Sharing one request's token budget among its media items.
//!
//! The budget is what the context leaves for media: context length − prompt text tokens − max_tokens.
//! Every item's plugin can say what the item costs at native size (`plan` with no limit) and what its
//! cheapest acceptable plan costs (the `over-budget` error of `plan` with a budget of 0). When the native
//! sizes fit, nothing is cut. Otherwise each item gets `clamp(level, cheapest, native)` tokens, with the
//! water level as high as the budget allows, so small items keep their native size and the large ones
//! share what is left evenly; the plugins then plan within those shares, and what a plugin did not use
//! (its sizes come in steps) goes to the reduced items in order. A request whose cheapest plans do not
//! fit is refused with the number of tokens it needs.

use mmgate_host::{CallError, PluginError, TokenPlan};

/// Why the items could not be planned.
#[derive(Debug, thiserror::Error)]
pub enum BudgetError {
    /// Even the cheapest plan of every item needs `needed` tokens, more than `available`.
    #[error(
        "the media needs at least {needed} tokens but only {available} are left of the context"
    )]
    TooSmall { needed: u64, available: u32 },
    /// An item's plugin failed.
    #[error("media item {item}: {error}")]
    Plugin { item: usize, error: CallError },
}

/// Plans every item within `budget` tokens in all (one item: its plan within the whole budget). `plan(i, max_tokens)` asks item `i`'s plugin for
/// its plan within `max_tokens` (a plugin returns the most it can within the limit, or `over-budget`
/// with what its cheapest plan needs).
pub fn allocate(
    items: usize,
    budget: u32,
    plan: impl Fn(usize, u32) -> Result<TokenPlan, CallError>,
) -> Result<Vec<TokenPlan>, BudgetError> {
    let plan_item = |item: usize, max_tokens: u32| {
        plan(item, max_tokens).map_err(|error| BudgetError::Plugin { item, error })
    };
    if items == 1 {
        // Nothing to share: the plugin plans within the whole budget, and says itself (over-budget)
        // when even its cheapest plan does not fit.
        return Ok(vec![plan_item(0, budget)?]);
    }
    let native: Vec<TokenPlan> = (0..items)
        .map(|i| plan_item(i, u32::MAX))
        .collect::<Result<_, _>>()?;
    let total = |plans: &[TokenPlan]| plans.iter().map(|p| u64::from(p.tokens)).sum::<u64>();
    if total(&native) <= u64::from(budget) {
        return Ok(native);
    }

    let cheapest: Vec<u32> = (0..items)
        .map(|i| match plan(i, 0) {
            Ok(p) => Ok(p.tokens),
            Err(CallError::Plugin(PluginError::OverBudget(o))) => Ok(o.needed_tokens),
            Err(error) => Err(BudgetError::Plugin { item: i, error }),
        })
        .collect::<Result<_, _>>()?;
    let needed: u64 = cheapest.iter().map(|&c| u64::from(c)).sum();
    if needed > u64::from(budget) {
        return Err(BudgetError::TooSmall {
            needed,
            available: budget,
        });
    }

    let native_tokens: Vec<u32> = native.iter().map(|p| p.tokens).collect();
    let shares = water_fill(&cheapest, &native_tokens, budget);
    let mut plans = Vec::with_capacity(items);
    for (item, (&share, native_plan)) in shares.iter().zip(&native).enumerate() {
        plans.push(if share >= native_plan.tokens {
            native_plan.clone()
        } else {
            plan_item(item, share)?
        });
    }

    // Plugins plan in steps (a resolution, a chunk): hand what they left to the reduced items.
    let mut slack = u64::from(budget).saturating_sub(total(&plans));
    for item in 0..items {
        if slack == 0 {
            break;
        }
        if plans[item].tokens >= native_tokens[item] {
            continue;
        }
        let more = u64::from(plans[item].tokens) + slack;
        let retry = plan_item(item, u32::try_from(more).unwrap_or(u32::MAX))?;
        if retry.tokens > plans[item].tokens {
            slack -= u64::from(retry.tokens - plans[item].tokens);
            plans[item] = retry;
        }
    }
    Ok(plans)
}

/// Each item's share: `clamp(level, cheapest, native)` with the highest level whose shares sum to at
/// most `budget`, then the remainder (less than one token per item) to the first items with room.
/// Requires Σ cheapest ≤ budget < Σ native.
fn water_fill(cheapest: &[u32], native: &[u32], budget: u32) -> Vec<u32> {
    let shares_at = |level: u32| -> Vec<u32> {
        cheapest
            .iter()
            .zip(native)
            .map(|(&low, &high)| level.clamp(low, high.max(low)))
            .collect()
    };
    let sum = |shares: &[u32]| shares.iter().map(|&s| u64::from(s)).sum::<u64>();
    let (mut low, mut high) = (0u32, native.iter().copied().max().unwrap_or(0));
    while low < high {
        let mid = low + (high - low).div_ceil(2);
        if sum(&shares_at(mid)) <= u64::from(budget) {
            low = mid;
        } else {
            high = mid - 1;
        }
    }
    let mut shares = shares_at(low);
    let mut remainder = u64::from(budget).saturating_sub(sum(&shares));
    for (share, &high) in shares.iter_mut().zip(native) {
        if remainder == 0 {
            break;
        }
        if *share < high {
            *share += 1;
            remainder -= 1;
        }
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;
    use mmgate_host::contract::OverBudget;

    /// A plugin whose sizes come in steps of `step` tokens from `cheapest` to `native`: what the
    /// built-in plugins do (resolutions, 30 s chunks).
    fn stepped(
        cheapest: u32,
        native: u32,
        step: u32,
        max_tokens: u32,
    ) -> Result<TokenPlan, CallError> {
        let tokens = if max_tokens >= native {
            native
        } else if max_tokens < cheapest {
            return Err(CallError::Plugin(PluginError::OverBudget(OverBudget {
                needed_tokens: cheapest,
                budget_tokens: max_tokens,
                message: String::new(),
            })));
        } else {
            cheapest + (max_tokens - cheapest) / step * step
        };
        Ok(TokenPlan {
            tokens,
            reduced: tokens < native,
            reason: String::new(),
            choices: "{}".into(),
        })
    }

    /// `allocate` over stepped plugins given as (cheapest, native, step): the tokens of each plan.
    fn shares(items: &[(u32, u32, u32)], budget: u32) -> Result<Vec<u32>, BudgetError> {
        let plans = allocate(items.len(), budget, |i, b| {
            let (cheapest, native, step) = items[i];
            stepped(cheapest, native, step, b)
        })?;
        Ok(plans.iter().map(|p| p.tokens).collect())
    }

    #[test]
    fn native_sizes_that_fit_are_not_cut() {
        let items = [(4, 100, 1), (4, 50, 1)];
        assert_eq!(shares(&items, 150).unwrap_or_default(), [100, 50]);
    }

    #[test]
    fn small_items_keep_their_size_and_large_ones_share_the_rest() {
        let items = [(4, 60, 1), (4, 1000, 1), (4, 1000, 1)];
        assert_eq!(shares(&items, 1060).unwrap_or_default(), [60, 500, 500]);
    }

    #[test]
    fn what_a_stepped_plugin_leaves_goes_to_the_next_reduced_item() {
        // Shares are 500/500, the first plugin can only use 400; the second takes the 100 left.
        let items = [(100, 1000, 100), (1, 1000, 1)];
        assert_eq!(shares(&items, 1000).unwrap_or_default(), [500, 500]);
        let items = [(100, 1000, 300), (1, 1000, 1)];
        assert_eq!(shares(&items, 1000).unwrap_or_default(), [400, 600]);
    }

    #[test]
    fn an_item_whose_cheapest_plan_is_large_gets_it_first() {
        let items = [(700, 900, 1), (1, 1000, 1)];
        assert_eq!(shares(&items, 1000).unwrap_or_default(), [700, 300]);
    }

    #[test]
    fn a_budget_below_the_cheapest_plans_says_what_is_needed() {
        let items = [(300, 900, 1), (256, 1000, 1)];
        let error = shares(&items, 500).err();
        assert!(
            matches!(
                error,
                Some(BudgetError::TooSmall {
                    needed: 556,
                    available: 500
                })
            ),
            "{error:?}"
        );
    }

    #[test]
    fn the_total_never_exceeds_the_budget() {
        // Cheapest plans sum to 19 tokens, native sizes to 11505.
        let items = [(3, 2000, 7), (10, 500, 30), (1, 9000, 1), (5, 5, 1)];
        assert!(matches!(
            shares(&items, 18),
            Err(BudgetError::TooSmall { needed: 19, .. })
        ));
        for budget in [19u32, 99, 1000, 4321, 10_000, 11_505] {
            let tokens = shares(&items, budget).unwrap_or_else(|e| panic!("{budget}: {e}"));
            let sum: u32 = tokens.iter().sum();
            assert!(sum <= budget, "{budget}: {sum}");
            assert!(
                budget - sum < 30,
                "{budget}: {tokens:?} leaves too much unused"
            );
        }
    }
    #[test]
    fn one_item_gets_the_whole_budget_and_its_plugins_own_error() {
        assert_eq!(shares(&[(4, 100, 1)], 60).unwrap_or_default(), [60]);
        let error = shares(&[(40, 100, 1)], 30).err();
        assert!(
            matches!(error, Some(BudgetError::Plugin { item: 0, .. })),
            "{error:?}"
        );
    }
}
