// The built-in demo corpus. Written for this repository by its authors and released under the repository's
// license; it contains no third-party text. Plain ASCII prose, a few KB: enough for a byte-level model to show a
// falling loss within a few dozen steps on a CPU.

#include "twobp/data.h"

namespace twobp::data {

namespace {

constexpr char kCorpus[] = R"corpus(On the Keeping of a Small Orchard

The orchard stands at the bottom of the hill, where the ground is wet in spring and dry by the middle of summer.
There are eleven apple trees, three pears, a plum that leans toward the road, and a quince that nobody planted.
Every year the work begins in the cold months, when the branches are bare and the shape of each tree can be seen.
A good pruner walks around a tree twice before making the first cut. The first time she looks at the whole crown;
the second time she looks at the places where light cannot reach. A branch that crosses another will rub a wound
into the bark, and a wound lets in the rot. So the crossing branch is taken away, cleanly, just outside the collar.

The saw must be sharp and the ladder must be steady. A steady ladder stands on three feet, not four, because three
feet always find the ground. The pruner climbs slowly and keeps one hand for the tree. When the wind rises she comes
down and waits, because no branch is worth a fall. Patience is the first tool of the orchard and the last one to be
put away.

In early spring the buds swell. The apple buds are round and soft; the leaf buds are thin and pointed. A late frost
can kill the blossom in a single night, and then there is nothing to do but wait for the next year. Some growers
light small fires between the rows, some run water over the trees so that the ice holds the flowers at the freezing
point, and some simply hope. The old trees have seen many frosts. They bloom a little later than the young ones, as
if they had learned to be careful.

When the blossom opens, the bees arrive. The orchard keeps four hives at the edge of the field, facing the morning
sun. A bee will visit the flowers of one kind of tree on one journey, and so the pollen of an apple is carried to
another apple, and the pollen of a pear to another pear. Apples do not set fruit with their own pollen; they need a
neighbour of a different variety that flowers at the same time. That is why the rows are mixed, and why the crab
apple by the gate is never cut down, though its fruit is small and sour.

By midsummer the young fruit is the size of a walnut, and there is far too much of it. The tree would carry every
apple if it could, and break its branches doing so, and bear nothing the following year. So the fruit is thinned by
hand: one apple to a cluster, a hand's width between clusters. It feels wasteful to drop so many green apples into
the grass, but the ones that remain grow large and sweet, and the tree keeps its strength.

The grass between the trees is cut three times a year. It is not cut short, because the clover in it feeds the bees
and the roots hold the soil when the rain comes hard. Along the hedge the nettles are left alone for the butterflies.
An orchard is not a factory; it is a small country with many citizens, and most of them are too small to see.

Harvest comes in a long wave rather than a single day. The early apples ripen in late summer and do not keep; they
are eaten at once or pressed for juice. The late apples hang on until the first frosts and are picked into wooden
crates lined with paper. A ripe apple comes away from the spur when it is lifted and turned a quarter of a circle.
If it must be pulled, it is not ready. Apples are never dropped into the crate; they are placed, because a bruise
today is a rotten apple next month.

The store room is cool, dark and a little damp. The crates are stacked with gaps between them so that the air can
move. Once a week someone walks along the stacks and takes out any apple that has begun to soften, because one bad
apple really does spoil the crate. By the turn of the year the store smells of wood and fruit, and the apples that
were hard and sharp in autumn have become mellow.

A Note on Counting

The keeper of the orchard writes everything down. She counts the trees, the hives, the crates, and the days of frost.
She notes the date of the first blossom and the date of the last apple picked. Over the years the notebook has become
more useful than any book she ever bought, because it describes this ground and these trees and no others.

One page lists the trees by row and number. Row one: two Bramleys, a Cox, a Discovery. Row two: a Russet, an Egremont,
a Spartan, a pear called Conference. Row three: two more pears, the plum, the quince, and three young trees grafted
from the oldest Bramley, which had begun to hollow out. Grafting is a kind of copying. A twig is cut from the old tree
and joined to a young root, and the twig remembers what it was. The new tree bears the same apples as the old one,
exactly the same, because it is the same tree continued.

Another page records the work of each month. January: prune the apples and pears. February: finish pruning, mend the
fences, check the stakes. March: feed the trees with compost, clear the grass from around the young trunks. April:
watch for frost, watch the bees. May: watch for pests, hang the moth traps. June: thin the fruit. July: thin again,
water the young trees. August: pick the early apples. September: pick, press, store. October: pick the late apples,
gather the windfalls for the pigs. November: plant new trees while the soil is warm. December: rest, and read the
notebook from the beginning.

A Short Lesson in Division of Labour

When there are many hands in the orchard, the harvest goes faster, but only if the work is divided well. Suppose four
people pick apples. If each of them picks, carries, sorts and stores, they spend half their time walking. If instead
the first picks, the second carries, the third sorts and the fourth stores, each person does one thing and does it
quickly. The apples move down the line like water down a channel. This is a pipeline.

A pipeline has a weakness. At the start of the day the carrier waits for the first full basket, the sorter waits for
the carrier, and the one who stores waits for everyone. At the end of the day the picker has finished while the others
are still busy. These waiting times are called the bubble. The bubble is smaller when the baskets are smaller and more
numerous, because the line fills sooner and empties sooner. But very small baskets mean many trips, and each trip has
a cost of its own.

There is a second trick. The sorter does two jobs: she checks each apple for bruises, which the next person needs at
once, and she writes the count in the notebook, which nobody needs until evening. If she checks the apples first and
leaves the writing for the quiet moments when no basket is waiting, the line moves faster and nothing is lost. The
notebook is still complete at the end of the day. The work was not reduced; it was moved to where it did no harm.

That is the whole secret of a good harvest: do first what others are waiting for, and do later what can wait. The same
rule keeps a kitchen running, a workshop busy and a school on time. It is older than any machine, and it will outlast
all of them.

Evening

When the light goes, the crates are counted one last time and the ladders are laid flat under the hedge. The bees go
home before the people do. The hill turns blue, then grey, and the orchard becomes a set of dark shapes against the
sky. Somewhere in the long grass a hedgehog starts its own harvest of slugs and fallen fruit. Tomorrow there will be
more to pick, and the day after that, until the trees are bare again and the pruning can begin.
)corpus";

}  // namespace

std::string_view builtin_corpus() { return std::string_view(kCorpus, sizeof(kCorpus) - 1); }

}  // namespace twobp::data
